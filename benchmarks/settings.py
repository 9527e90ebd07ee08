"""Everything one benchmark run is configured by, in one frozen, JSON-serialisable place.

`FULL` is what `make bench` runs (sized for about 15 minutes on the 2-core CPU machine); `QUICK` is a smoke
run of under a minute with short prompts and few tokens; `TINY` is for the tests.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from benchmarks.loadgen import Schedule
from benchmarks.workload import WorkloadSpec

SYSTEMS = ("naive", "dynamic", "hf_continuous", "llmserve", "llmserve_grpc", "llmserve_grpc_metrics")
GRPC_SYSTEMS = ("llmserve_grpc", "llmserve_grpc_metrics")
BASELINES = ("naive", "dynamic", "hf_continuous")


@dataclass(slots=True, frozen=True)
class Plan:
    """The main point (measured over two windows) and the concurrency sweep (one window each).

    `baseline_main`, when set, is the main point's timing for the baselines: they are several times slower
    than llmserve, so shorter windows still hold enough of their work, and the time saved goes to
    llmserve's windows, where the ratios' noise comes from. Single-worker baselines are measured at their
    batch size with that timing and composed for higher concurrencies; see `loadgen.compose_fifo`.
    """

    main: Schedule
    sweep: tuple[Schedule, ...]
    baseline_main: Schedule | None = None

    def main_for(self, system: str) -> Schedule:
        if system in BASELINES and self.baseline_main is not None:
            return self.baseline_main
        return self.main

    def schedule_for(self, concurrency: int) -> Schedule:
        for s in (self.main, *self.sweep):
            if s.concurrency == concurrency:
                return s
        return replace(self.main, concurrency=concurrency)

    @property
    def concurrencies(self) -> list[int]:
        return sorted({self.main.concurrency, *(s.concurrency for s in self.sweep)})


@dataclass(slots=True, frozen=True)
class EngineSettings:
    """Engine sizes shared by llmserve (in-process and gRPC) and transformers' continuous batching."""

    kv_cache_tokens: int = 64 * (1024 + 128)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16


@dataclass(slots=True, frozen=True)
class BenchSettings:
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    workload: WorkloadSpec = WorkloadSpec()
    plan: Plan = field(default_factory=lambda: FULL_PLAN)
    engine: EngineSettings = EngineSettings()
    dynamic_max_batch: int = 8
    dynamic_max_wait_s: float = 0.020
    hf_cpu_max_batch_tokens: int = 128  # transformers' CB's best on the 2-core CPU; see systems/hf_continuous.py
    roofline_quick: bool = False
    sweep_systems: tuple[str, ...] = SYSTEMS

    def sized(self) -> BenchSettings:
        """These settings with the engines' KV cache sized for the plan's worst case: every client of the
        largest concurrency at the longest prompt plus all its new tokens (no system has to preempt)."""
        w = self.workload
        tokens = max(self.plan.concurrencies) * (w.max_prompt + w.max_new_tokens)
        return replace(self, engine=replace(self.engine, kv_cache_tokens=tokens))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchSettings:
        raw = json.loads(text)
        plan = raw.pop("plan")
        raw["sweep_systems"] = tuple(raw["sweep_systems"])
        return cls(
            workload=WorkloadSpec(**raw.pop("workload")),
            plan=Plan(
                Schedule(**plan["main"]),
                tuple(Schedule(**s) for s in plan["sweep"]),
                Schedule(**plan["baseline_main"]) if plan.get("baseline_main") else None,
            ),
            engine=EngineSettings(**raw.pop("engine")),
            **raw,
        )


# About 14 minutes on the 2-core CPU machine with the gRPC system at the main point only (see run.py).
# At 32 clients a request lives ~40 s in llmserve and its throughput swings between prefill-heavy and
# decode-heavy stretches (10-s windows from 57 to 130 tok/s in one run), so its main point gets the
# longest windows. 64 clients' first prompts take ~35-40 s to prefill: with a 34-s warm-up the window
# caught that tail in one run of three (40 vs 76-84 tok/s), hence 40 s (about 12 s more in all).
FULL_PLAN = Plan(
    main=Schedule(concurrency=32, warmup_s=42.0, window_s=42.0, windows=2),
    sweep=(
        Schedule(concurrency=1, warmup_s=3.0, window_s=9.0),
        Schedule(concurrency=4, warmup_s=5.0, window_s=13.0),
        Schedule(concurrency=16, warmup_s=12.0, window_s=14.0),
        Schedule(concurrency=64, warmup_s=40.0, window_s=16.0),
    ),
    baseline_main=Schedule(concurrency=32, warmup_s=36.0, window_s=30.0, windows=2),
)
# An H200 does in seconds what takes minutes here; both GPU shapes must fit one ~10-minute script.
GPU_PLAN = Plan(
    main=Schedule(concurrency=32, warmup_s=3.0, window_s=5.0, windows=2),
    sweep=tuple(Schedule(concurrency=c, warmup_s=1.5, window_s=4.0) for c in (1, 4, 16, 64)),
)
QUICK_PLAN = Plan(main=Schedule(concurrency=8, warmup_s=3.0, window_s=3.0, windows=2), sweep=())
TINY_PLAN = Plan(
    main=Schedule(concurrency=4, warmup_s=0.3, window_s=0.5, windows=2),
    sweep=(Schedule(concurrency=1, warmup_s=0.2, window_s=0.4),),
)
QUICK_WORKLOAD = WorkloadSpec(min_prompt=32, max_prompt=128, max_new_tokens=16)
TINY_WORKLOAD = WorkloadSpec(min_prompt=8, max_prompt=32, max_new_tokens=8)
