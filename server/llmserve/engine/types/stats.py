"""The stats records the engine's parts keep and the metrics read: one latency histogram type for the parts that
time their own operations (the history stores, the KV tiers' reloads), and each optional part's snapshot (the KV
tiers', speculation's, the LoRA adapters'), carried in EngineStats (protocol.py). Torch-free and Prometheus-free: a
part keeps them without knowing whether metrics are on, and the Prometheus collectors read them at scrape time."""

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


@dataclass(slots=True)
class TierCounters:
    """What one tier did since start (for the metrics); bytes are KV payload bytes."""

    stored_blocks: int = 0
    stored_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evicted_blocks: int = 0
    failed_stores: int = 0  # a write that failed (full disk, I/O error) or was dropped: the block is recomputed
    failed_loads: int = 0  # a block missing, truncated, corrupt or of another model: recomputed instead


@dataclass(slots=True)
class TierStats:
    """A snapshot for the metrics: per tier counters and occupancy, and the reload time histogram."""

    tiers: dict[str, TierCounters]
    used_blocks: dict[str, int]
    capacity_blocks: dict[str, int]
    block_bytes: int
    reload: LatencyHistogram  # from a block's reload request to its KV ready for the step
    dropped_writes: int


@dataclass(slots=True)
class SpecStats:
    """Counters since start (plain ints, read by other threads without a lock), and the last step's choice."""

    steps: int = 0  # steps in which at least one sequence verified drafts
    proposed: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    emitted: int = 0  # tokens emitted by the verifying sequences (accepted + one each, less any past a stop)
    verifying: int = 0  # sequence-steps that verified drafts
    off_steps: int = 0  # decoding steps where the load rule left speculation off
    k_counts: dict[int, int] = field(default_factory=dict)  # drafts per verifying sequence-step -> how often

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per verifying sequence-step."""
        return self.accepted / self.verifying if self.verifying else 0.0


@dataclass(slots=True, frozen=True)
class LoraStats:
    """The adapters' part of EngineStats, for the metrics: a snapshot taken on the step thread."""

    max_loras: int
    running: tuple[str, ...]  # adapters with a running request, sorted
    waiting: tuple[str, ...]  # adapters with waiting requests only, sorted
    changed: float  # unix time the running or waiting set last changed
    registered: int
    resident: int  # in host memory
    requests: tuple[tuple[str, int], ...]  # requests admitted per registered adapter since start (or its load)
    slot_writes: int  # adapters copied into a device slot
    reads: int  # adapter folders read (loads, and re-reads of adapters unloaded to make room)
