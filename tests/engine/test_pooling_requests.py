"""A generative model's pooling requests in the engine's continuous batch (Embed with --pooling): prefill-only sequences
chunked like any prompt, their last chunk's (or every chunk's) final hidden states pooled by the backend, equal to
transformers' last_hidden_state of the same model; generation beside them unchanged token for token; what a
prefix-cache hit does for each pooling; blocks freed at the end. On the fused CPU forward and on transformers' layers
(--no-fused-layers), the tiny Llama in float32."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.outputs import Delta, FinishReason
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import GenerationRequest, PoolingParams, StoppingParams
from llmserve.models.loader import from_config, with_pooling
from tests.engine.engine_helpers import inner
from tests.testing import tiny_config

# A budget of 64 tokens a step: prompts of 150 are read in three chunks.
CONFIG = EngineConfig(block_size=16, kv_cache_tokens=8192, max_num_seqs=16, max_num_batched_tokens=64)
TOLERANCE = 1e-4


def tiny_pooled() -> LoadedModel:
    return with_pooling(from_config(tiny_config(max_positions=512), dtype=torch.float32), None, "last")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_pooled()


@pytest.fixture(params=["fused", "transformers layers"])
async def engine(request: pytest.FixtureRequest, loaded: LoadedModel) -> AsyncEngine:
    config = dataclasses.replace(CONFIG, fused_layers=request.param == "fused")
    eng = AsyncEngine(loaded, config)
    await eng.start()
    yield eng
    await eng.shutdown()


def prompts(n: int, length: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 500) for _ in range(length - rng.randrange(0, length // 3))) for _ in range(n)]


_REFERENCE: list[LoadedModel] = []


def reference(loaded: LoadedModel, prompt: tuple[int, ...], mode: PoolingMode) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of the whole prompt, pooled: the same weights (the
    same seed) in a model of their own, with transformers' attention (the served one's is the engine's)."""
    if not _REFERENCE:
        _REFERENCE.append(from_config(tiny_config(max_positions=512), dtype=torch.float32))
    with torch.inference_mode():
        hidden = _REFERENCE[0].model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()
    if mode is PoolingMode.LAST:
        return hidden[-1]
    if mode is PoolingMode.CLS:
        return hidden[0]
    if mode is PoolingMode.MAX:
        return hidden.amax(0)
    return hidden.mean(0)


async def final(engine: AsyncEngine, request: GenerationRequest) -> Delta:
    deltas = [delta async for delta in engine.generate(request)]
    assert len(deltas) == 1 and deltas[0].finish_reason is FinishReason.LENGTH, deltas
    return deltas[0]


def pooling_request(i: int, prompt: tuple[int, ...], mode: PoolingMode) -> GenerationRequest:
    return GenerationRequest(
        f"pool-{i}-{mode.value}", prompt, stopping=StoppingParams(max_new_tokens=1), pooling=PoolingParams(mode)
    )


async def generate(engine: AsyncEngine, i: int, prompt: tuple[int, ...]) -> list[int]:
    request = GenerationRequest(f"gen-{i}", prompt, stopping=StoppingParams(max_new_tokens=24, ignore_eos=True))
    return [t async for delta in engine.generate(request) for t in delta.token_ids]


@pytest.mark.parametrize("mode", list(PoolingMode))
async def test_each_pooling_over_chunks_equals_transformers(
    engine: AsyncEngine, loaded: LoadedModel, mode: PoolingMode
) -> None:
    for i, prompt in enumerate(prompts(3, 150, seed=1)):
        delta = await final(engine, pooling_request(i, prompt, mode))
        assert delta.embedding is not None and delta.token_ids == []
        got = torch.tensor(delta.embedding)
        assert (got - reference(loaded, prompt, mode)).abs().max().item() <= TOLERANCE
        assert delta.usage is not None and delta.usage.prompt_tokens == len(prompt)
        assert delta.usage.completion_tokens == 0


async def test_beside_generation_the_tokens_and_the_vectors_are_unchanged(
    engine: AsyncEngine, loaded: LoadedModel
) -> None:
    gen_prompts = prompts(4, 40, seed=2)
    alone = [await generate(engine, i, p) for i, p in enumerate(gen_prompts)]
    pool_prompts = prompts(8, 150, seed=3)
    modes = [PoolingMode.LAST, PoolingMode.MEAN] * 4
    pooled = [pooling_request(10 + i, p, m) for i, (p, m) in enumerate(zip(pool_prompts, modes, strict=True))]
    together = await asyncio.gather(
        *(generate(engine, i, p) for i, p in enumerate(gen_prompts)), *(final(engine, r) for r in pooled)
    )
    assert together[:4] == alone
    for delta, prompt, mode in zip(together[4:], pool_prompts, modes, strict=True):
        assert isinstance(delta, Delta) and delta.embedding is not None
        assert (torch.tensor(delta.embedding) - reference(loaded, prompt, mode)).abs().max().item() <= TOLERANCE
    core = inner(engine)
    assert not core.scheduler.live and len(core.backend.paged.states) == 0  # nothing of any request kept
    assert core.pool.num_free == core.pool.num_blocks  # every block back (free or cached, unreferenced)


async def test_a_prefix_cache_hit_serves_last_token_pooling_and_mean_pooling_recomputes(
    engine: AsyncEngine, loaded: LoadedModel
) -> None:
    (prompt,) = prompts(1, 150, seed=4)
    for mode, cached in ((PoolingMode.LAST, True), (PoolingMode.MEAN, False)):
        first = await final(engine, pooling_request(20, prompt, mode))
        again = await final(engine, pooling_request(21, prompt, mode))
        assert first.usage is not None and again.usage is not None
        assert (again.usage.cached_prompt_tokens > 0) is cached, (mode, again.usage)
        want = reference(loaded, prompt, mode)
        for delta in (first, again):
            assert delta.embedding is not None
            assert (torch.tensor(delta.embedding) - want).abs().max().item() <= TOLERANCE


async def test_dimensions_and_normalize_apply_to_a_decoders_vector(engine: AsyncEngine, loaded: LoadedModel) -> None:
    (prompt,) = prompts(1, 30, seed=5)
    request = dataclasses.replace(
        pooling_request(30, prompt, PoolingMode.LAST), pooling=PoolingParams(PoolingMode.LAST, True, 16)
    )
    delta = await final(engine, request)
    assert delta.embedding is not None and len(delta.embedding) == 16
    want = torch.nn.functional.normalize(reference(loaded, prompt, PoolingMode.LAST)[:16], dim=0)
    assert (torch.tensor(delta.embedding) - want).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("mode", [PoolingMode.MEAN, PoolingMode.MAX])
async def test_a_pooled_prompt_preempted_mid_way_restarts_its_pooling(loaded: LoadedModel, mode: PoolingMode) -> None:
    """A pool of 20 blocks: a 300-token pooled prompt (19 blocks) beside a generating stream outgrows it mid-prompt,
    is preempted (it is the newest) and read again from its first token once the stream is done: the vector is the
    unpreempted one (what the first attempts pooled is dropped, not counted twice). Max pooling over rows seen twice
    is the same maximum: only mean pooling shows a state kept across the restart; max is here for the restart."""
    config = EngineConfig(
        block_size=16, kv_cache_tokens=320, max_num_seqs=4, max_num_batched_tokens=64, pooling_share=1.0
    )
    (prompt,) = prompts(1, 300, seed=6)
    prompt = (prompt * 2)[:300]
    engine = AsyncEngine(loaded, config)
    await engine.start()
    try:
        stream = engine.generate(
            GenerationRequest("gen", (5,) * 32, stopping=StoppingParams(max_new_tokens=40, ignore_eos=True))
        )
        first = await anext(stream)  # the stream runs (and is older) before the pooled prompt arrives
        assert first.token_ids
        pooled, _ = await asyncio.gather(final(engine, pooling_request(40, prompt, mode)), _drain(stream))
        core = inner(engine)
        assert core.scheduler.num_preemptions > 0
        alone = await final(engine, pooling_request(41, prompt, mode))
    finally:
        await engine.shutdown()
    assert pooled.embedding is not None and alone.embedding is not None
    assert (torch.tensor(pooled.embedding) - torch.tensor(alone.embedding)).abs().max().item() <= TOLERANCE
    assert (torch.tensor(pooled.embedding) - reference(loaded, prompt, mode)).abs().max().item() <= TOLERANCE


async def _drain(stream: AsyncIterator[Delta]) -> None:
    async for _ in stream:
        pass


async def test_a_large_call_beside_one_stream_is_read_within_the_stated_bound(loaded: LoadedModel) -> None:
    """Scheduler.pooling_cap's bound, in steps: 256 inputs of 20 tokens (N = 5,120) beside one generating stream get
    P(1) = floor((1 + F) s / (1 - s)) tokens a step (s the default 0.2, F given: 63, so 16 tokens), so they are
    read within ceil(N / P(1)) steps of the last one's admission (two more: the step in flight when it arrives, and
    the step that ends the last), while the stream generates all along. The stream runs 40 steps past the bound, so
    that the cap applies to every step the call takes: under the rule before F, max(1, ceil(G s / (1 - s))), one
    token a step, the call would need 5,120 steps and finishes only after the stream ends (planted: 436 steps against
    a bound of 322)."""
    config = dataclasses.replace(CONFIG, pooling_share=EngineConfig().pooling_share, pooling_step_tokens=63)
    share, fixed = config.pooling_share, 63
    per_step = max(1, math.floor((1 + fixed) * share / (1 - share) + 1e-9))
    inputs = [tuple(3 + (7 * i + k) % 400 for k in range(20)) for i in range(256)]
    bound = math.ceil(20 * len(inputs) / per_step) + 2
    engine = AsyncEngine(loaded, config)
    await engine.start()
    try:
        core = inner(engine)
        # The core's step count where it admits the last input and where it ends each, read on its own thread: the
        # event loop's 256 submissions and its reads of the finals run beside a core that steps the stream on (the
        # counter read here before and after the gather took 326 steps against a bound of 322 on a loaded machine).
        admitted: list[int] = []
        ended: list[int] = []
        admit, finish = core._admit, core.finish

        def admit_counted(command: Any, constraint: Any) -> None:
            if command.request.pooling is not None:
                admitted.append(core.steps)
            admit(command, constraint)

        def finish_counted(seq: Any, reason: FinishReason, **options: Any) -> None:
            finish(seq, reason, **options)
            if seq.request_id != "gen":
                ended.append(core.steps)

        core._admit, core.finish = admit_counted, finish_counted  # type: ignore[method-assign]
        stream = engine.generate(
            GenerationRequest("gen", (5,) * 32, stopping=StoppingParams(max_new_tokens=bound + 40, ignore_eos=True))
        )
        await anext(stream)
        finals = await asyncio.gather(
            *(final(engine, pooling_request(100 + i, p, PoolingMode.MEAN)) for i, p in enumerate(inputs))
        )
        assert len(admitted) == len(ended) == len(inputs)
        taken = max(ended) - max(admitted)
        generated = [t async for delta in stream for t in delta.token_ids]
    finally:
        await engine.shutdown()
    assert all(delta.embedding is not None for delta in finals)
    assert taken <= bound, (taken, bound, per_step)
    assert len(generated) == bound + 40 - 1  # the stream ran on beside them, to its end
