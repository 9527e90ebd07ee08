"""From final hidden states to the vectors Embed returns: pooling over each input's tokens, sentence-transformers'
Dense projections, Matryoshka truncation and normalization.

Hidden states come packed: the rows of every sequence of a forward one after another, [tokens, hidden], with
`seq_lens` saying how many rows each sequence has (the layout of the encoder's forward and of a decoder's prefill
chunk). A decoder's long input arrives over several prefill chunks; `PoolingState` carries one input's pooling from
chunk to chunk (the sum of rows for mean pooling, accumulated in float32, so that only one vector is kept, never
the hidden states of the chunks before).

The order of the steps is sentence-transformers' own: pool, project (Dense, in the folder's order), then keep the
first `dimensions` entries and normalize (sentence-transformers' Normalize module normalizes the whole vector
before a caller truncates it; normalizing again after truncating gives the same vector as normalizing once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve.engine.types.model import ClassifierHead
from llmserve.engine.types.pooling import DenseModule, PoolingMode
from llmserve.engine.types.request import PoolingParams

__all__ = ["DenseStack", "PoolingState", "finish", "pool", "pooled_rows"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "relu": F.relu,
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
}


def pool(hidden: torch.Tensor, seq_lens: Sequence[int], mode: PoolingMode) -> torch.Tensor:
    """One vector per sequence from packed hidden states `hidden` [sum(seq_lens), H]: [len(seq_lens), H].

    Every sequence must have at least one row. Mean and max are computed in float32 whatever the hidden states'
    dtype (the result has that dtype back), as sentence-transformers accumulates.
    """
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError("pool needs at least one sequence, each of at least one row")
    if sum(seq_lens) != hidden.shape[0]:
        raise ValueError(f"seq_lens add up to {sum(seq_lens)} rows, hidden has {hidden.shape[0]}")
    ends = torch.tensor(seq_lens, device=hidden.device).cumsum(0)
    if mode is PoolingMode.CLS:
        return hidden[ends - ends.new_tensor(seq_lens)]
    if mode is PoolingMode.LAST:
        return hidden[ends - 1]
    # One reduction per sequence over its slice, not index_add_/scatter_reduce_ over segment ids: on this CPU build
    # those cost ~0.5 ms per call even for one 30-row sequence (torch 2.13, 2 threads), 42% of the encoder
    # process's samples at 32 callers one text each (py-spy; benchmarks/README.md, "Embed throughput").
    parts = hidden.float().split_with_sizes(list(seq_lens))
    if mode is PoolingMode.MEAN:
        out = torch.stack([part.sum(0) for part in parts])
        out /= torch.tensor(seq_lens, dtype=out.dtype, device=out.device)[:, None]
    else:
        out = torch.stack([part.amax(0) for part in parts])
    return out.to(hidden.dtype)


@dataclass(slots=True)
class PoolingState:
    """One input's pooling over the chunks its hidden states arrive in (a decoder's chunked prefill).

    `add` each chunk's rows in order; `result` is what `pool` gives over all of them at once. Only one vector is
    kept between chunks: the first row (CLS), the latest last row (LAST), the float32 sum (MEAN) or maximum (MAX).
    """

    mode: PoolingMode
    rows: int = 0
    _acc: torch.Tensor | None = field(default=None, repr=False)

    def add(self, chunk: torch.Tensor) -> None:
        """Take the next chunk's hidden states [n, H] (n >= 1)."""
        if chunk.ndim != 2 or chunk.shape[0] < 1:
            raise ValueError(f"a chunk is [rows >= 1, hidden], got {tuple(chunk.shape)}")
        mode, acc = self.mode, self._acc
        if mode is PoolingMode.CLS:
            if acc is None:
                self._acc = chunk[0].clone()
        elif mode is PoolingMode.LAST:
            self._acc = chunk[-1].clone()
        elif mode is PoolingMode.MEAN:
            total = chunk.float().sum(0)
            self._acc = total if acc is None else acc + total
        else:
            top = chunk.float().amax(0)
            self._acc = top if acc is None else torch.maximum(acc, top)
        self.rows += chunk.shape[0]

    def result(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The pooled vector [H] (in `dtype`, default float32 for mean and max, else the chunks' dtype)."""
        if self._acc is None:
            raise ValueError("no chunk was added")
        out = self._acc / self.rows if self.mode is PoolingMode.MEAN else self._acc
        return out if dtype is None else out.to(dtype)


@dataclass(slots=True)
class DenseLayer:
    """One sentence-transformers Dense module's weights on the device: activation(x @ weight.T + bias)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _ACTIVATIONS[self.activation](F.linear(x, self.weight, self.bias))


@dataclass(slots=True)
class DenseStack:
    """The Dense projections of an embedding model's folder, applied in order after pooling (none: identity)."""

    layers: tuple[DenseLayer, ...] = ()

    @classmethod
    def load(
        cls, modules: Sequence[DenseModule], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> DenseStack:
        """Read each module's weights from its folder (model.safetensors, else pytorch_model.bin)."""
        layers = []
        for module in modules:
            state = _read_weights(module.folder)
            weight = state["linear.weight"]
            if tuple(weight.shape) != (module.out_features, module.in_features):
                raise ValueError(
                    f"{module.folder}: linear.weight is {tuple(weight.shape)}, config says "
                    f"{(module.out_features, module.in_features)}"
                )
            bias = state.get("linear.bias") if module.bias else None
            if module.bias and bias is None:
                raise ValueError(f"{module.folder}: no linear.bias")
            layers.append(
                DenseLayer(
                    weight.to(device=device, dtype=dtype),
                    None if bias is None else bias.to(device=device, dtype=dtype),
                    module.activation,
                )
            )
        return cls(tuple(layers))

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            vectors = layer(vectors.to(layer.weight.dtype))
        return vectors


def end_vectors(
    pooled: torch.Tensor, params: PoolingParams, *, head: ClassifierHead | None, dense: DenseStack
) -> torch.Tensor:
    """Pooled vectors [B, H] as Embed returns them, on every backend: a classifier's logits in float32 (its head over
    the pooled states; the edge refuses dimensions and normalize for a classifier), else the folder's Dense modules
    and then `finish` (dimensions, normalize). Raises ValueError for dimensions the vectors cannot give."""
    if head is not None:
        return head(pooled).float()
    return finish(dense(pooled), dimensions=params.dimensions, normalize=params.normalize)


def finish(vectors: torch.Tensor, *, dimensions: int | None = None, normalize: bool = False) -> torch.Tensor:
    """Pooled (and projected) vectors [B, E] as Embed returns them: the first `dimensions` entries (None: all),
    then scaled to unit L2 length when `normalize` (as torch's F.normalize: a zero vector stays zero)."""
    if dimensions is not None:
        if not 1 <= dimensions <= vectors.shape[-1]:
            raise ValueError(f"dimensions must be in [1, {vectors.shape[-1]}], got {dimensions}")
        vectors = vectors[..., :dimensions]
    if normalize:
        vectors = F.normalize(vectors.float(), p=2.0, dim=-1).to(vectors.dtype)
    return vectors


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    safetensors_file = folder / "model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    bin_file = folder / "pytorch_model.bin"
    if bin_file.is_file():
        state: dict[str, torch.Tensor] = torch.load(bin_file, map_location="cpu", weights_only=True)
        return state
    raise ValueError(f"{folder}: no model.safetensors or pytorch_model.bin")


def pooled_rows(mode: PoolingMode, start: int, first: int, last: int, ends: bool) -> range:
    """Which packed rows [first, last) of a chunk that computes positions from `start` a pooling reads: every row
    (mean, max), the prompt's first (CLS: in the chunk that starts at 0), its last (LAST: in the chunk that `ends`
    the prompt)."""
    if mode is PoolingMode.CLS:
        return range(first, first + 1) if start == 0 else range(0)
    if mode is PoolingMode.LAST:
        return range(last - 1, last) if ends else range(0)
    return range(first, last)
