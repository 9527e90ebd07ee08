"""One latency histogram type for the parts that time their own operations (the history stores, the KV tiers'
reloads) and are read by the Prometheus collectors at scrape time. Torch-free and Prometheus-free: a part keeps
it without knowing whether metrics are on."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field


@dataclass(slots=True)
class LatencyHistogram:
    """Observed durations in buckets of upper bounds `bounds` (seconds, ascending; a last bucket for the rest),
    with their sum and count. One writer at a time; a reader on another thread gets a consistent-enough view
    (each field is updated atomically under the GIL), as a Prometheus scrape expects."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; the last is above every bound
    total_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"bucket bounds must be ascending and distinct, got {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' buckets: (upper bound, observations at or below it), ending with +Inf (the count)."""
        rows, running = [], 0
        for bound, n in zip((*self.bounds, None), self.counts, strict=True):
            running += n
            rows.append(("+Inf" if bound is None else str(bound), running))
        return rows

    def snapshot(self) -> LatencyHistogram:
        """A copy, for a stats message that leaves this thread (or this process)."""
        copy = dataclasses.replace(self)
        copy.counts = list(self.counts)
        return copy
