"""The pooling cap's step costs F and M (core/pooling_cost.py): derived from the three steps' times as the module says,
measured once at start by an engine core that serves Embed beside generation, unless --pooling-step-tokens gives it,
and used by the scheduler's cap."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.core.pooling_cost import POOLED, PROMPT, measure
from llmserve.engine.types.outputs import EngineOutput
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import GenerationRequest, PoolingParams
from llmserve.models.loader import from_config, with_pooling
from tests.testing import tiny_config

CONFIG = EngineConfig(block_size=16, kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=128)


class TimedSteps:
    """Steps that take a known time on a clock of their own, by place in the measurement's turn: `times` (s) for the
    step that reads the prompt, the one that decodes its first token, and the one that decodes beside the pooled
    prompt (a device whose step costs a + c n, without a real clock's noise)."""

    def __init__(self, *times: float) -> None:
        self.times = times
        self.now = 0.0
        self.steps_of_turn = 0
        self.requests: list[GenerationRequest] = []
        self.live: set[int] = set()

    def clock(self) -> float:
        return self.now

    def add_now(self, request: GenerationRequest, handle: int) -> None:
        self.requests.append(request)
        self.live.add(handle)
        if request.pooling is None:
            self.steps_of_turn = 0

    def cancel_now(self, handle: int) -> None:
        self.live.discard(handle)

    def step(self) -> None:
        self.now += self.times[self.steps_of_turn]
        self.steps_of_turn += 1

    def take_outputs(self) -> list[EngineOutput]:
        return []


POOLING = PoolingParams(PoolingMode.LAST)


def test_f_and_m_are_what_the_three_steps_times_give() -> None:
    """One token 10 ms, PROMPT tokens 90 ms, one token beside POOLED pooled 43 ms: c = 47 / 47 = 1 ms a token,
    F = 10 / c - 1 = 9, M = (43 - 10) / c - 16 = 17. Each turn's prompts are its own (none a prefix-cache hit), the
    pooled one a pooling request; every request is ended."""
    target = TimedSteps(0.090, 0.010, 0.043)
    cost = measure(target, vocab_size=1000, max_tokens=512, pooling=POOLING, clock=target.clock)
    assert (PROMPT, POOLED) == (64, 16)
    assert (cost.one_token_ms, cost.prompt_ms, cost.mixed_ms) == pytest.approx((10, 90, 43))
    assert (cost.prompt_tokens, cost.fixed_tokens, cost.chunk_tokens) == (64, 9, 17)
    prompts = [r.prompt_token_ids for r in target.requests]
    assert len(set(prompts)) == len(prompts) == 8 and not target.live
    assert [r.pooling for r in target.requests[1::2]] == [POOLING] * 4


def test_f_and_m_stay_within_the_step_budget() -> None:
    """Steps that cost the same whatever they read (all fixed cost): F is the budget and M 0, not infinite or
    negative; a budget under PROMPT bounds the prompt too; a pooled chunk cheaper than its tokens gives M 0."""
    flat = TimedSteps(0.004, 0.004, 0.004)
    cost = measure(flat, vocab_size=1000, max_tokens=48, pooling=POOLING, clock=flat.clock)
    assert cost.prompt_tokens == 48 and (cost.fixed_tokens, cost.chunk_tokens) == (48, 0)
    odd = TimedSteps(0.090, 0.010, 0.012)
    cost = measure(odd, vocab_size=1000, max_tokens=512, pooling=POOLING, clock=odd.clock)
    assert cost.chunk_tokens == 0


def _pooled() -> object:
    return with_pooling(from_config(tiny_config(max_positions=512), dtype=torch.float32), None, "last")


def test_a_core_serving_embed_beside_generation_measures_f_once_and_its_cap_uses_it() -> None:
    core = EngineCore(_pooled(), CONFIG)  # type: ignore[arg-type]
    core.warm_up()
    cost = core.pooling_cost
    assert cost is not None and 0 <= cost.fixed_tokens <= CONFIG.max_num_batched_tokens
    assert core.scheduler.pooling_step_tokens == cost.fixed_tokens
    assert core.scheduler.pooling_chunk_tokens == cost.chunk_tokens
    assert core.scheduler.pooling_share == CONFIG.pooling_share  # uncapped only while it measured
    assert not core.scheduler.has_work  # the measurement's requests are gone
    core.warm_up()
    assert core.pooling_cost is cost  # once


def test_the_flag_gives_f_and_nothing_is_measured() -> None:
    core = EngineCore(_pooled(), dataclasses.replace(CONFIG, pooling_step_tokens=7))  # type: ignore[arg-type]
    core.warm_up()
    assert core.pooling_cost is None and core.scheduler.pooling_step_tokens == 7
    assert core.scheduler.pooling_chunk_tokens == 0


@pytest.mark.parametrize("change", [{"pooling_share": 1.0}, {}])
def test_no_measurement_where_the_cap_does_not_apply(change: dict[str, float]) -> None:
    """--pooling-share 1 lifts the cap; a model without --pooling serves no Embed."""
    loaded = _pooled() if change else from_config(tiny_config(max_positions=512), dtype=torch.float32)
    core = EngineCore(loaded, dataclasses.replace(CONFIG, **change))  # type: ignore[arg-type]
    core.warm_up()
    assert core.pooling_cost is None
