"""An encoder step's inputs, packed: the sequences' tokens one after another (`EncoderBatch`), and the runs of
sequences of like length that attend together (`AttentionGroup`), each padded to its own longest only. The encoder
backend packs each step's whole inputs so (encoder_backend.py); the BERT encoder (models/encoder.py) computes over
them, its linears, layer norms and embeddings never on a padding row (the measurements are in its docstring).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """A run of consecutive sequences of a batch that attend in one call: their packed rows [start, stop), `count`
    sequences padded to `longest`; `scatter` maps each row to its place in the [count * longest] block and
    `key_mask` [count, 1, 1, longest] marks the real keys, both None when the sequences are all `longest` long
    (no padding: the rows are the block)."""

    start: int
    stop: int
    count: int
    longest: int
    scatter: torch.Tensor | None
    key_mask: torch.Tensor | None


# A group of sequences pads them to its longest; a sequence joins the run before it while the padded block stays
# within this factor of the run's real tokens. With every sequence of a step padded to the step's longest,
# attention was a fifth of the encoder's time (py-spy, 32-text Embed calls; the CPU's SDPA computes the padding).
# Steps of 512 tokens of tests/data/sentences.txt, each sorted by length, all-MiniLM-L6-v2, 2 threads, 5
# alternated repetitions: 276.0 embeddings/s in one group, 286.6 with this slack (1.5: about the same).
PADDING_SLACK = 1.25


@dataclass(slots=True)
class EncoderBatch:
    """Sequences packed for one forward: `token_ids` [tokens] (int64), the sequences one after another;
    `seq_lens` how many tokens each has; `positions` [tokens], each token's index in its sequence;
    `token_type_ids` [tokens] or None (all segment 0); `groups` the runs of sequences that attend together
    (AttentionGroup). Sequences given in order of length pack into the fewest, least padded groups."""

    token_ids: torch.Tensor
    seq_lens: tuple[int, ...]
    positions: torch.Tensor
    token_type_ids: torch.Tensor | None
    groups: tuple[AttentionGroup, ...]

    @property
    def longest(self) -> int:
        """The longest sequence's length."""
        return max(self.seq_lens)

    @classmethod
    def pack(
        cls,
        sequences: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> EncoderBatch:
        """A batch of `sequences` of token ids (each at least one token)."""
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("an encoder batch needs at least one sequence, each of at least one token")
        lens = tuple(len(s) for s in sequences)
        # numpy for the index arithmetic: torch's repeat_interleave without an output size took ~0.75 ms a call
        # with two threads (a pool wake-up and a sync for a few hundred integers), several calls a step.
        counts = np.array(lens, dtype=np.int64)
        starts = np.cumsum(counts) - counts
        positions = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
        ids = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.int64)
        types = None
        if token_type_ids is not None:
            if [len(t) for t in token_type_ids] != list(lens):
                raise ValueError("token_type_ids must have one entry per token")
            types = torch.tensor([t for s in token_type_ids for t in s], dtype=torch.int64).to(device)
        return cls(
            token_ids=ids.to(device),
            seq_lens=lens,
            positions=torch.from_numpy(positions).to(device),
            token_type_ids=types,
            groups=tuple(_groups(lens, positions, device)),
        )


def _groups(lens: tuple[int, ...], positions: np.ndarray, device: torch.device | str) -> list[AttentionGroup]:
    """The runs of consecutive sequences that attend together (PADDING_SLACK); `positions`: each packed row's index
    in its sequence."""
    groups: list[AttentionGroup] = []
    first, row = 0, 0
    while first < len(lens):
        last, longest, real = first + 1, lens[first], lens[first]
        while last < len(lens):
            wider = max(longest, lens[last])
            if (last - first + 1) * wider > PADDING_SLACK * (real + lens[last]):
                break
            longest, real, last = wider, real + lens[last], last + 1
        count = last - first
        scatter = key_mask = None
        if real != count * longest:
            members = np.array(lens[first:last], dtype=np.int64)
            rows = np.repeat(np.arange(count, dtype=np.int64), members)
            scatter = torch.from_numpy(rows * longest + positions[row : row + real]).to(device)
            mask = np.arange(longest)[None, :] < members[:, None]
            key_mask = torch.from_numpy(mask[:, None, None, :]).to(device)
        groups.append(AttentionGroup(row, row + real, count, longest, scatter, key_mask))
        first, row = last, row + real
    return groups
