"""Each sampled sequence's own stream of random numbers, kept for the sampler between steps.

The streams are not in the request types (`SampleRow` names its stream by key and seed, and stays torch-free);
they live here. Each backend owns one `RandomStreams`, on its device (`Backend.streams`), and passes it to
`sampler.sample_each`; the engine core releases a sequence's stream when the sequence ends.
"""

from __future__ import annotations

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

    def stream(self, row: SampleRow) -> torch.Generator:
        """The row's stream, started from `row.seed` if its key has none yet; ValueError for a row without a seed."""
        generator = self._streams.get(row.key)
        if generator is None:
            if row.seed is None:
                raise ValueError(f"sequence {row.key}: sampled (temperature {row.params.temperature}) without a seed")
            generator = self._streams[row.key] = torch.Generator(device=self.device).manual_seed(row.seed)
        return generator

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
