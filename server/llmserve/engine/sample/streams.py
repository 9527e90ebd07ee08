"""Each sampled sequence's own stream of random numbers, kept for the sampler between steps.

The streams are not in the request types (`SampleRow` names its stream by key and seed, and stays torch-free);
they live here. Each decoder backend keeps one `RandomStreams`, on its device, behind its `Backend` protocol (with
what else it keeps per sequence: backends/paged.py's `SequenceStates`), and passes it to `sampler.sample_each`; the
engine core releases a sequence's state in the backend when the sequence ends. Speculation reaches a stream only
through the backend's `mark_stream` (a `StreamMark`), the overlapped runner only through its `rewind_stream`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from llmserve.engine.sched.sequence import SampleRow


class RandomStreams:
    """Every live sampled sequence's random stream (a torch.Generator on `device`), by `SampleRow.key`.

    A stream starts from the row's seed the first time its key is sampled, and goes on from step to step while
    the key lives: across preemption and recompute too (a preempted sequence keeps the tokens it generated, so
    replaying its first draws would not replay its answer). `release` drops it: the engine core calls it when a
    sequence ends (finished, aborted, failed, or the engine died), so that nothing is held once requests end.
    """

    __slots__ = ("device", "_streams")

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._streams: dict[int, torch.Generator] = {}

    def __len__(self) -> int:
        """How many streams are held (one per sequence sampled and not yet released)."""
        return len(self._streams)

    def __contains__(self, key: object) -> bool:
        return key in self._streams

    def __iter__(self) -> Iterator[int]:
        """The keys of the streams held."""
        return iter(self._streams)

    def stream(self, row: SampleRow) -> torch.Generator:
        """The row's stream, started from `row.seed` if its key has none yet; ValueError for a row without a seed."""
        generator = self._streams.get(row.key)
        if generator is None:
            if row.seed is None:
                raise ValueError(f"sequence {row.key}: sampled (temperature {row.params.temperature}) without a seed")
            generator = self._streams[row.key] = torch.Generator(device=self.device).manual_seed(row.seed)
        return generator

    def mark(self, row: SampleRow) -> StreamMark:
        """The row's stream as it stands now (started from its seed if it has none yet), to `settle` later."""
        return StreamMark(self, row)

    def release(self, key: int) -> None:
        """Drop the stream of a sequence that ended (none held is fine: greedy, or never sampled)."""
        self._streams.pop(key, None)

    def rewind(self, key: int, seed: int, draws: int) -> None:
        """Set a stream to where `draws` samples from `seed` leave it (one uniform float32 number per sampled row,
        as sampler.sample draws): for a sequence whose last sample was dropped (preempted while its step was in
        flight, core/steps.py's OverlapRunner), so that the dropped position draws again what it drew."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for _ in range(draws):
            torch.rand((), generator=generator, device=self.device)
        self._streams[key] = generator


class StreamMark:
    """A sampled sequence's random stream as it was before the sampler drew for its positions; `settle` leaves
    it as if only the emitted positions had drawn (spec/verify.py: a verification's positions each draw, only the
    emitted ones may keep their draws)."""

    __slots__ = ("generator", "state")

    def __init__(self, streams: RandomStreams, row: SampleRow) -> None:
        self.generator = streams.stream(row)  # started from the row's seed if it has no stream yet
        self.state = self.generator.get_state()

    def settle(self, emitted: int) -> None:
        """Rewind the stream and draw again for the `emitted` positions, as sampler.sample draws (one uniform
        float32 number per row, on the stream's device)."""
        self.generator.set_state(self.state)
        for _ in range(emitted):
            torch.rand((), generator=self.generator, device=self.generator.device)
