"""bfloat16, int8 and a GGUF's blocks on the CPU are batch-invariant: a request's greedy tokens alone equal its
tokens among 32 concurrent requests, whatever chunks its prompt was split into, whether it was preempted and
recomputed, and whether its prompt came back from a session's cache.

Random weights in bfloat16 make near-ties of many logits, so that a prompt token attended otherwise than a
decoded one (SDPA for prompt chunks, as the float32 path does) changes tokens here. The model's MLP is 1,536 wide,
a reduction oneDNN's bfloat16 kernel blocks by the row count; that it differs by a bfloat16 step in a few values
at most is caught in tests/engine/backends/cpu/test_packed_linear.py, not reliably here.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import inner
from tests.gguf_helpers import Q, gguf_loaded, write_llama_gguf
from tests.isa import dtype_param
from tests.testing import TINY_VOCAB, tiny_config

SESSIONS = 8  # of the 32 requests, 8 are the second turns of sessions whose first turn ran just before
TIMEOUT_S = 120


def model(dtype: str) -> LoadedModel:
    config = tiny_config("llama")
    config.intermediate_size = 1536
    if dtype.startswith("gguf"):  # a GGUF's blocks (q/k Q4_0, the rest Q8_0), activations quantized per block
        source = from_config(config, dtype=torch.float32, seed=3).model  # ("gguf") or float32 ("gguf-float32")
        kinds = {f"blk.{i}.{n}.weight": Q.Q4_0 for i in range(2) for n in ("attn_q", "attn_k")}
        path = write_llama_gguf(Path(tempfile.mkdtemp(prefix="llmserve-gguf-")) / "tiny.gguf", source, kinds)
        return gguf_loaded(path, config, activations="int8" if dtype == "gguf" else "float32")
    loaded = from_config(config, dtype=torch.bfloat16, seed=3)
    loaded.weights = "int8" if dtype == "int8" else None
    return loaded


async def generate(engine: AsyncEngine, request: GenerationRequest) -> list[int]:
    tokens: list[int] = []
    async with asyncio.timeout(TIMEOUT_S):
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
    return tokens


def request(rid: str, prompt: list[int], max_new: int, session: str | None = None) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), stopping=StoppingParams(max_new, ignore_eos=True), session_id=session)


@pytest.mark.parametrize("dtype", [dtype_param("bfloat16"), dtype_param("int8"), "gguf", "gguf-float32"])
async def test_greedy_tokens_alone_equal_those_among_32_concurrent_requests(dtype: str) -> None:
    loaded = model(dtype)
    rng = random.Random(5)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.choice([1, 7, 40, 130, 290]))] for _ in range(32)]
    max_new = [rng.randint(8, 24) for _ in prompts]

    # Alone: one request at a time, nothing cached, every prompt in one chunk.
    alone_config = EngineConfig(kv_cache_tokens=8192, max_num_batched_tokens=1024, enable_prefix_caching=False)
    engine = AsyncEngine(loaded, alone_config)
    await engine.start()
    try:
        fused = inner(engine).backend.fused
        assert fused is not None and fused.precision.linears == dtype
        alone = [await generate(engine, request(f"a{i}", p, max_new[i])) for i, p in enumerate(prompts)]
        # Each session's second turn: its first turn's prompt and answer and a new message, computed whole.
        first_turns = prompts[:SESSIONS]
        turns = [p + alone[i] + prompts[-1 - i][:30] for i, p in enumerate(first_turns)]
        alone_turns = [await generate(engine, request(f"t{i}", t, max_new[i])) for i, t in enumerate(turns)]
    finally:
        await engine.shutdown()

    # Together: 32 streams at once, 64 tokens a step (prompts in chunks, beside decodes), a pool that holds
    # about a sixth of them (preemption), the prefix cache on. The sessions' first turns run first, among
    # themselves; then their second turns (reusing the KV of those the pool kept) arrive at once with the 24
    # others, which come over the next 0.3 s: second turns first, so that the scheduler takes them before the
    # others' prompts evict their sessions (at random arrivals all 8 were evicted in 1 of 8 runs).
    config = EngineConfig(kv_cache_tokens=640, max_num_seqs=32, max_num_batched_tokens=64)
    engine = AsyncEngine(loaded, config)
    await engine.start()
    jitter = random.Random(6)

    async def one(i: int) -> list[int]:
        await asyncio.sleep(jitter.random() * 0.3)
        return await generate(engine, request(f"c{i}", prompts[i], max_new[i]))

    def turn(i: int, prompt: list[int], second: bool) -> GenerationRequest:
        return request(f"s{i}{'b' if second else ''}", prompt, max_new[i], session=f"conv{i}")

    try:
        firsts = await asyncio.gather(*(generate(engine, turn(i, p, False)) for i, p in enumerate(first_turns)))
        seconds, others = await asyncio.gather(
            asyncio.gather(*(generate(engine, turn(i, t, True)) for i, t in enumerate(turns))),
            asyncio.gather(*(one(i) for i in range(SESSIONS, len(prompts)))),
        )
        stats = inner(engine).stats()
    finally:
        await engine.shutdown()
    assert list(firsts) == alone[:SESSIONS]
    assert list(seconds) == alone_turns
    assert list(others) == alone[SESSIONS:]
    assert inner(engine).scheduler.num_preemptions > 0
    assert stats.session_hits > 0, stats  # second turns that found their session's KV (others were evicted)
