"""The Triton varlen paged-attention kernel (backends/triton_attention.py), run on the CPU through Triton's
interpreter, equals plain causal attention over each sequence's gathered context: scattered block tables,
prompt chunks and decodes in one launch, random lengths, grouped-query attention."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

# Through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET before anything imports Triton; tests/engine/
# conftest.py mends the interpreter for NumPy 2.4).
triton = pytest.importorskip("triton", reason="Triton is not installed (the dev extra installs it)")
assert os.environ.get("TRITON_INTERPRET") == "1", "these tests run Triton's interpreter on CPU tensors"

from llmserve.engine.backends.triton_attention import varlen_paged_attention  # noqa: E402


def reference(q, k_cache, v_cache, query_start, seq_lens, tables, block_size, scale):  # noqa: ANN001, ANN201
    """Per sequence: gather its context's K/V through the block table, causal attention in float64."""
    out = torch.zeros_like(q, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    group = heads // kv_heads
    for s in range(len(seq_lens)):
        start, end, length = int(query_start[s]), int(query_start[s + 1]), int(seq_lens[s])
        n = end - start
        slots = [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(length)]
        k = k_cache[:, slots].double().repeat_interleave(group, dim=0)  # [heads, length, dim]
        v = v_cache[:, slots].double().repeat_interleave(group, dim=0)
        qs = q[start:end].double().transpose(0, 1)  # [heads, n, dim]
        scores = qs @ k.transpose(1, 2) * scale
        positions = torch.arange(length - n, length)
        scores.masked_fill_(torch.arange(length)[None, :] > positions[:, None], float("-inf"))
        out[start:end] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "seed"),
    [(9, 3, 64, 16, 1), (8, 8, 32, 16, 2), (16, 4, 16, 4, 3)],
)
def test_mixed_chunks_and_decodes_equal_causal_attention(
    heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int
) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 200
    # (cached tokens, new tokens): decodes (one new token after some context), chunks with and without context.
    shapes = [(rng.randint(0, 150), 1) for _ in range(4)] + [(0, rng.randint(2, 40)), (rng.randint(1, 90), 23)]
    rng.shuffle(shapes)
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered over the pool
    tables, lens, starts = [], [], [0]
    for cached, new in shapes:
        length = cached + new
        tables.append([free.pop() for _ in range(-(-length // block_size))])
        lens.append(length)
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = (num_blocks + 1) * block_size
    k_cache = torch.randn(kv_heads, slots, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, slots, head_dim, generator=gen)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen)
    query_start = torch.tensor(starts, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    max_query = max(new for _, new in shapes)
    out = varlen_paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_tables, max_query, block_size, scale)
    expected = reference(q, k_cache, v_cache, query_start, seq_lens, block_tables, block_size, scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_unsupported_shapes_are_refused() -> None:
    q = torch.zeros(1, 4, 24)
    with pytest.raises(ValueError, match="head_dim"):
        varlen_paged_attention(q, torch.zeros(2, 16, 24), torch.zeros(2, 16, 24), *_one_seq(), 1, 16, 1.0)
    with pytest.raises(ValueError, match="kv heads"):
        q = torch.zeros(1, 5, 16)
        varlen_paged_attention(q, torch.zeros(2, 16, 16), torch.zeros(2, 16, 16), *_one_seq(), 1, 16, 1.0)


def _one_seq() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
    )


async def _generate_all(engine, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:  # noqa: ANN001
    from llmserve.engine.types.request import GenerationRequest, StoppingParams

    async def one(i: int) -> list[int]:
        request = GenerationRequest(f"r{i}", tuple(prompts[i]), stopping=StoppingParams(max_new[i], ignore_eos=True))
        tokens: list[int] = []
        async with asyncio.timeout(120):
            async for delta in engine.generate(request):
                tokens.extend(delta.token_ids)
        return tokens

    await engine.start()
    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("graphs", [False, True])
async def test_engine_with_the_varlen_kernel_equals_generate(graphs: bool) -> None:
    """The torch backend with the Triton kernel for every step (chunks and decodes in one launch), and the CUDA
    backend's graph path (buckets by batch size alone, replayed eagerly here): greedy output equals generate."""
    from llmserve.engine.backends import create_backend
    from llmserve.engine.backends.cuda import CudaBackend
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.frontend.async_engine import AsyncEngine
    from llmserve.models.loader import from_config
    from tests.testing import greedy_reference, tiny_config

    loaded = from_config(tiny_config(), dtype=torch.float32)
    loaded.model.set_attn_implementation("sdpa")  # the reference runs transformers' own attention
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 40)]
    lengths = [6, 2, 4]  # requests that end at different steps: a row leaves from the middle of the batch
    expected = [greedy_reference(loaded.model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    config = EngineConfig(
        block_size=16, kv_cache_tokens=1024, max_num_seqs=4, max_num_batched_tokens=32, attention_kernel="triton"
    )
    engine = AsyncEngine(loaded, config)
    if graphs:
        backend = create_backend(loaded, config, engine.core.engine_core.max_model_len, kind="cuda", capture=False)
        assert isinstance(backend, CudaBackend)
        assert backend.graphs.buckets == (1, 2, 4)  # the batch size alone: the context is not part of the key
    else:
        backend = create_backend(loaded, config, engine.core.engine_core.max_model_len, kind="torch")
    assert backend.varlen_kernel is not None and backend.num_blocks == engine.core.engine_core.pool.num_blocks
    engine.core.engine_core.backend = backend
    outputs = await _generate_all(engine, prompts, lengths)
    if graphs:
        assert backend.graphs.replays > 0
    assert outputs == expected
