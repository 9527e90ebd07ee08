"""The load rule's step-cost table, measured where the engine serves: at start-up, on the engine's own step.

A decode step's time by batch size and drafts per sequence is what decides whether speculation pays (policy.py),
and it depends on the device, the model, the kernels and the machine's load: phase 1 measured it twice on the same
CPU and the cells moved by more than they differ (benchmarks/README.md). So the engine measures it itself, once,
before serving: for each batch size, that many throwaway requests decode while every one verifies k drafts, for each
k, and the step's wall time (schedule, forward, sampling, books) is the cell. The requests are aborted after.

The k's of a batch size are timed in turns (every k once, then every k again, `repeats` times, after one untimed
turn for each shape's first step), and each cell is the median of its turns: a drift of the machine's speed while
the table is measured then moves every k of a row alike, instead of the k's measured last, and the ratios between a
row's cells (what the load rule weighs) keep still from one start to the next.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from llmserve.engine.spec.policy import CostTable
from llmserve.engine.types.outputs import EngineOutput
from llmserve.engine.types.request import GenerationRequest, StoppingParams

if TYPE_CHECKING:
    from llmserve.engine.sched.scheduler import Scheduler
    from llmserve.engine.spec.drafter import Drafter

BATCHES = (1, 4, 16, 32)
KS = (0, 1, 2, 4, 8, 16)
PROMPT = 16


class CalibrationTarget(Protocol):
    """What the measurement drives: a core's own step, and requests started and ended past its inbox (the engine
    core, on its step thread, before it serves)."""

    scheduler: Scheduler
    max_model_len: int

    def add_now(self, request: GenerationRequest, handle: int) -> None: ...

    def cancel_now(self, handle: int) -> None: ...

    def step(self) -> None: ...

    def take_outputs(self) -> list[EngineOutput]: ...


def calibrate(
    core: CalibrationTarget,
    drafter: Drafter,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    batches: tuple[int, ...] = BATCHES,
    ks: tuple[int, ...] = KS,
    repeats: int = 3,
) -> CostTable:
    """Time the core's step at each (batch, k) that fits its limits, every decoding sequence verifying k drafts from
    `drafter` (the core's); returns the table (ms)."""
    sizes = tuple(b for b in batches if b <= max_num_seqs) or (1,)
    rows: list[list[float]] = []
    for b in sizes:
        fitting = [k for k in ks if b * (k + 1) <= max_num_batched_tokens]
        handles = [_start(core, f"calibrate-{b}-{i}", -1 - i) for i in range(b)]
        try:
            while any(seq.num_uncomputed != 1 for seq in core.scheduler.running) or len(core.scheduler.running) < b:
                core.step()
            samples: dict[int, list[float]] = {k: [] for k in fitting}
            for turn in range(repeats + 1):  # turn 0 untimed: the first step at each new shape
                for k in fitting:
                    ms = _step_ms(core, drafter, k)
                    if turn:
                        samples[k].append(ms)
            times = {k: statistics.median(v) for k, v in samples.items()}
        finally:
            drafter.forced_k = None
            for handle in handles:
                core.cancel_now(handle)
            core.take_outputs()
        rows.append([_at(times, k) for k in ks])
    return CostTable(sizes, ks, tuple(tuple(row) for row in rows))


def _start(core: CalibrationTarget, name: str, handle: int) -> int:
    prompt = tuple((7 * handle + j) % 97 + 3 for j in range(PROMPT))
    limit = max(8, core.max_model_len - PROMPT - 1)
    request = GenerationRequest(name, prompt, stopping=StoppingParams(max_new_tokens=limit, ignore_eos=True))
    core.add_now(request, handle)
    return handle


def _step_ms(core: CalibrationTarget, drafter: Drafter, k: int) -> float:
    """One step's wall time (ms) with every decoding sequence verifying k drafts."""
    drafter.forced_k = k
    start = time.perf_counter()
    core.step()
    return (time.perf_counter() - start) * 1000.0


def _at(times: dict[int, float], k: int) -> float:
    """A cell, or for a k that did not fit the token budget, the line through the two largest measured ks."""
    if k in times:
        return times[k]
    known = sorted(times)
    if len(known) < 2:
        return times[known[-1]] * (k + 1) if known else 0.0
    a, b = known[-2], known[-1]
    return times[b] + (times[b] - times[a]) / (b - a) * (k - b)


def load_table(path: str) -> CostTable:
    """A table measured elsewhere (--speculative-cost-table): {"rows": [{"batch", "k", "forward_ms"}, ...]}."""
    try:
        data = json.loads(Path(path).read_text())
        return CostTable.from_rows(data["rows"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--speculative-cost-table {path}: {exc}") from exc
