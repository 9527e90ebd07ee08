"""The compiled CPU decode-attention kernel equals attention over the gathered context, and the engine falls
back to its torch path where the kernel cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from llmserve.engine import native
from llmserve.engine.config import EngineConfig
from llmserve.engine.core import EngineCore
from llmserve.models import from_config
from tests.tiny import tiny_config


def gathered_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, bs: int, scale: float
) -> torch.Tensor:
    """q [seqs, heads, dim]; k/v [kv_heads, slots, dim]: each sequence's slots gathered, then plain softmax."""
    seqs, heads, dim = q.shape
    kv_heads = k.shape[0]
    out = torch.empty_like(q)
    for s in range(seqs):
        n = int(lens[s])
        slots = (tables[s].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
        qs = q[s].reshape(kv_heads, heads // kv_heads, dim)
        probs = torch.softmax(qs @ k[:, slots].transpose(1, 2) * scale, dim=-1)
        out[s] = (probs @ v[:, slots]).reshape(heads, dim)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (8, 2, 32)])
def test_kernel_equals_gathered_attention(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    kernel = native.load(dim, heads // kv_heads)
    assert kernel is not None, "the C compiler on this machine failed to build the kernel"
    gen = torch.Generator().manual_seed(heads * dim)
    bs, num_blocks = 16, 600
    k = torch.randn(kv_heads, num_blocks * bs, dim, dtype=dtype, generator=gen)
    v = torch.randn(kv_heads, num_blocks * bs, dim, dtype=dtype, generator=gen)
    lens = torch.tensor([1, 15, 16, 17, 100, 333, 1000, 5], dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    # Blocks out of order and scattered over the pool, as after churn; rows past a length hold garbage.
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    tables = tables.to(torch.int32).contiguous()
    # The query as the model makes it: [heads, tokens, dim] viewed per token.
    q = torch.randn(heads, len(lens), dim, dtype=dtype, generator=gen).transpose(0, 1)
    out = torch.full((len(lens), heads, dim), float("nan"), dtype=dtype)
    scale = dim**-0.5
    kernel(q, k, v, tables, lens, int(lens.max()), bs, scale, out)
    expected = gathered_attention(q, k, v, tables, lens, bs, scale)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_kernel_rejects_a_shape_it_was_not_built_for() -> None:
    kernel = native.load(16, 2)
    assert kernel is not None
    q = torch.zeros(1, 4, 32)
    k = torch.zeros(2, 16, 32)
    with pytest.raises(ValueError, match="head_dim"):
        kernel(q, k, k, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1, 16, 1.0, q.clone())


def test_engine_uses_the_kernel_on_cpu_and_falls_back_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = from_config(tiny_config("llama"), dtype=torch.float32)
    config = EngineConfig(kv_cache_tokens=256)
    assert EngineCore(loaded, config).runner.kernel is not None
    assert EngineCore(loaded, EngineConfig(kv_cache_tokens=256, native_attention=False)).runner.kernel is None

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        core = EngineCore(loaded, config)
    assert core.runner.kernel is None
    assert "torch path" in caplog.text
