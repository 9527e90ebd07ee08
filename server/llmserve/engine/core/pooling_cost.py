"""The pooling cap's step costs F and M, measured where the engine serves: at start-up, on the engine's own step.

Beside G generating sequences, pooling requests (Embed on a generative model) get r = (G + F) s / (1 - s) tokens'
worth of each step (Scheduler.pooling_cap), F being what a step costs whatever it computes, in tokens' worth of
compute (a step of n tokens costs about a + c n, F = a / c), and M what a step pays more, in tokens, for carrying a
pooling chunk at all (on the CPU such a step leaves the compiled step program for the fused forward's loop). Both
depend on the device, the model and the kernels: where a step mostly reads the weights (int8 rows, an AVX-512 or AMX
CPU) F was ~60; where each token's multiply-adds dominate (the exact float rows of a GGUF on an AVX2 CPU) F is ~3,
M ~4: 32 decoding streams took 122 ms a step and 64 pooling tokens beside them 151 ms more
(benchmarks/probes/mixed_step.py), so a fixed F of 63 let Embed callers take 30% of 32 streams' tokens/s where the
share promised 20%. So the engine measures them once, before serving, unless --pooling-step-tokens gives F (M is then
0): per turn, a step that reads a prompt of PROMPT tokens (T_N), a step that decodes that request's first token
(T_1, the decode path), and a step that decodes its next beside a pooling request of POOLED tokens (T_m); `repeats`
turns after one untimed one, medians. With the step's logits counted in its decode token:
    c = (T_N - T_m) / (PROMPT - 1 - POOLED),  F = T_1 / c - 1,  M = (T_m - T_1) / c - POOLED.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from llmserve.engine.types.outputs import EngineOutput
from llmserve.engine.types.request import GenerationRequest, PoolingParams, StoppingParams

log = logging.getLogger("llmserve.engine")

PROMPT = 64
POOLED = 16


class CostTarget(Protocol):
    """What the measurement drives: the engine core's own step, and requests started and ended past its inbox."""

    def add_now(self, request: GenerationRequest, handle: int) -> None: ...

    def cancel_now(self, handle: int) -> None: ...

    def step(self) -> None: ...

    def take_outputs(self) -> list[EngineOutput]: ...


@dataclass(frozen=True, slots=True)
class StepCost:
    """The measured step times (ms) and what they give, F and M within [0, the step's token budget]."""

    one_token_ms: float
    prompt_ms: float
    mixed_ms: float
    prompt_tokens: int
    fixed_tokens: int
    chunk_tokens: int


def measure(
    target: CostTarget,
    vocab_size: int,
    max_tokens: int,
    pooling: PoolingParams,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> StepCost:
    """Time the three kinds of step on `target` (its scheduler empty, pooling uncapped) by `clock` (seconds) and
    derive F and M; `max_tokens` (the step's token budget) bounds the prompt, F and M; `pooling`: the model's own."""

    def step_ms() -> float:
        start = clock()
        target.step()
        return 1e3 * (clock() - start)

    n = max(POOLED + 3, min(PROMPT, max_tokens))
    samples: list[tuple[float, float, float]] = []
    for turn in range(repeats + 1):  # turn 0 untimed: the first step of each shape
        handle = -1000 - 2 * turn  # negative: no client's
        # Prompts of their own each turn, so that the prefix cache has none of them.
        prompt = tuple(3 + (97 * turn + 31 * j) % max(1, vocab_size - 3) for j in range(n))
        pooled = tuple(3 + (89 * turn + 37 * j + 11) % max(1, vocab_size - 3) for j in range(POOLED))
        stopping = StoppingParams(max_new_tokens=4, ignore_eos=True)
        target.add_now(GenerationRequest(f"pooling-cost-{turn}", prompt, stopping=stopping), handle)
        try:
            prompt_ms = step_ms()  # the whole prompt: n <= the budget, one chunk
            one_ms = step_ms()  # its first decode
            request = GenerationRequest(
                f"pooling-cost-{turn}-pooled", pooled, stopping=StoppingParams(1), pooling=pooling
            )
            target.add_now(request, handle - 1)
            mixed_ms = step_ms()  # its next decode, and the pooled prompt whole (it ends there)
        finally:
            target.cancel_now(handle)
            target.cancel_now(handle - 1)
            target.take_outputs()
        if turn:
            samples.append((one_ms, prompt_ms, mixed_ms))
    one, whole, mixed = (statistics.median(column) for column in zip(*samples, strict=True))
    per_token = (whole - mixed) / (n - 1 - POOLED)
    if per_token <= 0:  # a step that costs the same whatever it reads: all fixed cost
        return StepCost(one, whole, mixed, n, max_tokens, 0)
    fixed = round(min(max_tokens, max(0.0, one / per_token - 1)))
    chunk = round(min(max_tokens, max(0.0, (mixed - one) / per_token - POOLED)))
    return StepCost(one, whole, mixed, n, fixed, chunk)
