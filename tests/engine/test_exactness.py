"""Greedy output of the engine equals transformers' `generate` for the same prompt run alone.

Tiny random-weight models in float64, so equality is exact: many requests at once, random arrival times,
prompts of 1 to 1,000 tokens, chunked prefill, and a pool small enough to force preemption.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.outputs import FinishReason
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import clear_cache
from tests.testing import TINY_VOCAB, greedy_reference, tiny_config


async def run_all(
    loaded: LoadedModel, config: EngineConfig, prompts: list[list[int]], max_new: list[int], jitter_s: float
) -> tuple[list[list[int]], AsyncEngine]:
    engine = AsyncEngine(loaded, config)
    await engine.start()
    rng = random.Random(1)

    async def one(i: int) -> list[int]:
        await asyncio.sleep(rng.random() * jitter_s)
        request = GenerationRequest(
            f"r{i}", tuple(prompts[i]), stopping=StoppingParams(max_new_tokens=max_new[i], ignore_eos=True)
        )
        tokens: list[int] = []
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
            if delta.finished:
                assert delta.finish_reason is FinishReason.LENGTH, delta.error
        return tokens

    try:
        outputs = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))), timeout=120)
    finally:
        await engine.shutdown()
    return list(outputs), engine


def tiny(family: str = "llama") -> LoadedModel:
    loaded = from_config(tiny_config(family), dtype=torch.float64)
    # Generate's references run with transformers' own attention; the engine swaps in its own later.
    loaded.model.set_attn_implementation("sdpa")
    return loaded


def random_prompts(n: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, max_len] + [rng.randint(1, max_len) for _ in range(n - 2)]
    return [[rng.randrange(TINY_VOCAB) for _ in range(length)] for length in lengths[:n]]


@pytest.mark.parametrize(
    ("concurrency", "kv_tokens", "native", "fused"),
    [
        (1, 4096, True, True),
        (8, 4096, True, True),
        (64, 1600, True, True),  # 1600 slots cannot hold 64 long prompts: preemption happens
        (8, 4096, False, True),  # the torch decode path (CUDA, or where the CPU kernel cannot be built)
        (8, 4096, True, False),  # transformers' own layers (other families, CUDA)
        (64, 1600, False, False),
    ],
)
async def test_greedy_equals_generate(concurrency: int, kv_tokens: int, native: bool, fused: bool) -> None:
    loaded = tiny()
    prompts = random_prompts(concurrency, 1000, seed=concurrency)
    rng = random.Random(concurrency)
    max_new = [rng.randint(1, 24) for _ in prompts]
    expected = [greedy_reference(loaded.model, p, m) for p, m in zip(prompts, max_new, strict=True)]
    config = EngineConfig(
        block_size=16,
        kv_cache_tokens=kv_tokens,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        native_attention=native,
        fused_layers=fused,
    )
    outputs, engine = await run_all(loaded, config, prompts, max_new, jitter_s=0.5)
    assert (engine.core.engine_core.backend.kernel is not None) == native
    assert (engine.core.engine_core.backend.fused is not None) == fused
    mismatched = [i for i in range(len(prompts)) if outputs[i] != expected[i]]
    assert not mismatched, f"{len(mismatched)} of {len(prompts)} differ, first: prompt of {len(prompts[mismatched[0]])}"
    if concurrency == 64:
        assert engine.core.engine_core.scheduler.num_preemptions > 0
    clear_cache(engine.core.engine_core.pool)
    assert engine.core.engine_core.pool.num_free == engine.core.engine_core.pool.num_blocks


async def test_preemption_really_happens_and_stays_exact() -> None:
    """A pool that holds about two of these requests at a time: sequences get preempted and recomputed."""
    loaded = tiny()
    prompts = random_prompts(6, 300, seed=7)
    expected = [greedy_reference(loaded.model, p, 20) for p in prompts]
    config = EngineConfig(block_size=8, kv_cache_tokens=700, max_num_seqs=6, max_num_batched_tokens=128)
    engine = AsyncEngine(loaded, config)
    await engine.start()
    try:
        outputs = await asyncio.gather(
            *(
                collect(engine, GenerationRequest(f"p{i}", tuple(p), stopping=StoppingParams(20, ignore_eos=True)))
                for i, p in enumerate(prompts)
            )
        )
    finally:
        await engine.shutdown()
    assert engine.core.engine_core.scheduler.num_preemptions > 0
    assert outputs == expected


async def collect(engine: AsyncEngine, request: GenerationRequest) -> list[int]:
    tokens: list[int] = []
    async with asyncio.timeout(60):  # a stuck engine fails in a minute, not at pytest's timeout
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
    return tokens


@pytest.mark.parametrize("native", [True, False])  # with and without the fused layers (gpt2 never has them)
@pytest.mark.parametrize("family", ["gpt2", "mistral", "qwen2", "qwen3"])
async def test_other_families_equal_generate(family: str, native: bool) -> None:
    loaded = tiny(family)
    prompts = random_prompts(8, 300, seed=3)
    max_new = [12] * len(prompts)
    expected = [greedy_reference(loaded.model, p, 12) for p in prompts]
    config = EngineConfig(
        block_size=16,
        kv_cache_tokens=4096,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        native_attention=native,
        fused_layers=native,
    )
    outputs, engine = await run_all(loaded, config, prompts, max_new, jitter_s=0.2)
    assert (engine.core.engine_core.backend.fused is not None) == (native and family != "gpt2")
    assert outputs == expected


@pytest.mark.real_model
async def test_real_model_greedy_equals_generate(real_model: LoadedModel) -> None:
    tok = real_model.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    prompts = [
        list(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        for q in questions
    ]
    real_model.model.set_attn_implementation("sdpa")
    expected = [greedy_reference(real_model.model, p, 16) for p in prompts]
    config = EngineConfig(block_size=16, kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=256)
    outputs, _ = await run_all(real_model, config, prompts, [16] * len(prompts), jitter_s=0.0)
    assert outputs == expected


async def test_padded_decode_path_equals_generate() -> None:
    """The bucketed, padded decode forward that CUDA graphs capture, run eagerly here on the CPU (the varlen kernel
    through Triton's interpreter). The requests end at different steps, so rows leave from the middle of the batch
    and the last rows move into the gaps."""
    from llmserve.engine.backends import create_backend
    from llmserve.engine.backends.cuda import CudaBackend

    loaded = tiny()
    prompts = random_prompts(5, 70, seed=11)  # a few blocks each: Triton's interpreter is slow
    lengths = [10, 3, 7, 5, 12]
    expected = [greedy_reference(loaded.model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    config = EngineConfig(
        block_size=16, kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=512, attention_kernel="triton"
    )
    engine = AsyncEngine(loaded, config)
    # The CUDA backend's logic on the CPU: every bucket prepared at start, replayed eagerly.
    backend = create_backend(loaded, config, engine.core.engine_core.max_model_len, kind="cuda", capture=False)
    assert isinstance(backend, CudaBackend)
    assert backend.num_blocks == engine.core.engine_core.pool.num_blocks
    assert len(backend.graphs) == 4  # batch buckets 1, 2, 4, 8: the varlen kernel reads any context
    engine.core.engine_core.backend = backend
    runner = backend
    await engine.start()
    try:
        requests = [
            GenerationRequest(f"g{i}", tuple(p), stopping=StoppingParams(n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        outputs = await asyncio.gather(*(collect(engine, r) for r in requests))
    finally:
        await engine.shutdown()
    assert runner.graphs.replays > 0, "no decode step went through the padded path"
    assert outputs == expected
