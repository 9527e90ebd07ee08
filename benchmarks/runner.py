"""Measures one system: builds it, runs its schedules, returns the raw measurements.

Run as `python -m benchmarks.runner SYSTEM SETTINGS_JSON OUT_JSON` so that each system gets a process of
its own (peak memory is then the system's own, and no system inherits another's state); `run.py` does that.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.loadgen import Measurement, RequestRecord, Schedule
from benchmarks.settings import BenchSettings
from benchmarks.systems.base import System
from benchmarks.workload import PromptMaker, RequestStream
from llmserve.engine.types.model import LoadedModel
from llmserve.models.loader import load_model

# Each run's prompts start at concurrency * STREAM_STRIDE: runs at one concurrency see the same prompts in
# every system, and no run meets a prompt (or its cached prefix) from another run.
STREAM_STRIDE = 1_000_000
BASE_WARMUP_S = 10.0


@dataclass(slots=True)
class SystemRun:
    """Raw results of one system: its measurements, wall time and machine load around them."""

    system: str
    measurements: list[Measurement] = field(default_factory=list)
    wall_s: float = 0.0
    loadavg_before: tuple[float, ...] = ()
    loadavg_after: tuple[float, ...] = ()
    group_size: int | None = None
    error: str | None = None


def schedules_for(name: str, group_size: int | None, settings: BenchSettings) -> list[Schedule]:
    """What to measure for real: every point (only the main one for systems left out of the sweep), or,
    for a single worker of batch size g, the points below g plus g itself with the main point's timing
    (the base that higher concurrencies are composed from)."""
    plan = settings.plan
    main = plan.main_for(name)
    if group_size is None:
        return [main, *plan.sweep] if name in settings.sweep_systems else [main]
    below = sorted((s for s in (main, *plan.sweep) if s.concurrency < group_size), key=lambda s: s.concurrency)
    # A single worker is in its steady state from the first group on: spend the main point's time on windows.
    warmup = min(main.warmup_s, BASE_WARMUP_S)
    window = (main.total_s - warmup) / main.windows
    return [*below, Schedule(group_size, warmup, window, main.windows)]


def build_system(name: str, loaded: LoadedModel, settings: BenchSettings, log_dir: Path) -> System:
    """Systems import lazily so that a missing optional piece only fails its own system."""
    e = settings.engine
    if name == "naive":
        from benchmarks.systems.naive import NaiveSystem

        return NaiveSystem(loaded)
    if name == "dynamic":
        from benchmarks.systems.dynamic import DynamicBatchingSystem

        return DynamicBatchingSystem(loaded, settings.dynamic_max_batch, settings.dynamic_max_wait_s)
    if name == "hf_continuous":
        from benchmarks.systems.hf_continuous import HFContinuousSystem

        step = settings.hf_cpu_max_batch_tokens if loaded.device.type == "cpu" else None
        return HFContinuousSystem(loaded, e.kv_cache_tokens, step, e.max_num_seqs)
    if name in ("llmserve", "llmserve_grpc", "llmserve_grpc_metrics"):
        from llmserve.engine.config import EngineConfig

        config = EngineConfig(
            block_size=e.block_size,
            kv_cache_tokens=e.kv_cache_tokens,
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            cuda_graphs=loaded.device.type == "cuda",
        )
        if name == "llmserve":
            from benchmarks.systems.engine import EngineSystem

            return EngineSystem(loaded, config)
        from benchmarks.systems.grpc_e2e import GrpcSystem

        dtype = str(loaded.dtype).removeprefix("torch.")
        log = log_dir / f"{name}-server.log"
        return GrpcSystem(settings.model, loaded.device, dtype, config, log, metrics=name == "llmserve_grpc_metrics")
    raise ValueError(f"unknown system {name!r}")


def load(settings: BenchSettings) -> LoadedModel:
    return load_model(settings.model, device=settings.device, dtype=settings.dtype)


async def measure(name: str, loaded: LoadedModel, settings: BenchSettings, log_dir: Path) -> SystemRun:
    """Build, start and measure one system; an error is recorded, not raised, so the other systems still run."""
    run = SystemRun(name, loadavg_before=os.getloadavg())
    started = time.perf_counter()
    maker = PromptMaker(settings.workload, loaded.tokenizer, loaded.vocab_size)
    system: System | None = None
    try:
        system = build_system(name, loaded, settings, log_dir)
        run.group_size = system.group_size
        await system.start()
        for schedule in schedules_for(name, system.group_size, settings):
            stream = RequestStream(maker, start=schedule.concurrency * STREAM_STRIDE)
            print(f"[{name}] concurrency {schedule.concurrency}: {schedule.total_s:.0f} s", file=sys.stderr, flush=True)
            run.measurements.append(await system.run(stream, schedule))
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] failed: {run.error}", file=sys.stderr, flush=True)
    finally:
        if system is not None:
            try:
                await system.stop()
            except Exception as exc:
                run.error = run.error or f"stop failed: {type(exc).__name__}: {exc}"
    run.wall_s = time.perf_counter() - started
    run.loadavg_after = os.getloadavg()
    return run


def run_to_json(run: SystemRun) -> dict:
    return asdict(run)


def run_from_json(raw: dict) -> SystemRun:
    measurements = []
    for m in raw.pop("measurements"):
        records = [RequestRecord(**r) for r in m.pop("records")]
        schedule = Schedule(**m.pop("schedule"))
        measurements.append(Measurement(schedule=schedule, records=records, **m))
    return SystemRun(measurements=measurements, **raw)


def main(argv: list[str]) -> int:
    name, settings_path, out_path = argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = BenchSettings.from_json(Path(settings_path).read_text())
    loaded = load(settings)
    if loaded.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(loaded.device)
    run = asyncio.run(measure(name, loaded, settings, Path(out_path).parent))
    Path(out_path).write_text(json.dumps(run_to_json(run)))
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    gc.freeze()  # done: the teardown need not collect torch's and the model's objects (~1.5 CPU-s, seconds of wall)
    sys.exit(status)
