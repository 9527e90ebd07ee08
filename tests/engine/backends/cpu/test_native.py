"""The compiled CPU decode-attention kernel equals attention over the gathered context, and the engine falls
back to its torch path where the kernel cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from llmserve.engine.backends.cpu import native
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.models.loader import from_config
from tests.testing import tiny_config


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


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 32)])
def test_bfloat16_cache_gives_the_float32_kernels_result_rounded(heads: int, kv_heads: int, dim: int) -> None:
    """A bfloat16 cache: each value widened exactly, float32 arithmetic, one rounding at the end. Many query rows
    over one sequence's blocks at growing lengths, as a prompt chunk's tokens go through it. The two functions are
    compiled apart, and a reduction's order may differ: within a bfloat16 step, nearly every value equal."""
    kernel = native.load(dim, heads // kv_heads)
    assert kernel is not None
    gen = torch.Generator().manual_seed(dim)
    bs, num_blocks, tokens = 16, 64, 45
    k = torch.randn(kv_heads, num_blocks * bs, dim, generator=gen).bfloat16()
    v = torch.randn(kv_heads, num_blocks * bs, dim, generator=gen).bfloat16()
    lens = torch.arange(1, tokens + 1, dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[:3].to(torch.int32).repeat(tokens, 1).contiguous()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).bfloat16()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # the fused forward's view of the q/k/v linear's rows
    out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
    wide = torch.empty(tokens, heads, dim)
    kernel(q, k, v, tables, lens, tokens, bs, dim**-0.5, out)
    kernel(q.float(), k.float(), v.float(), tables, lens, tokens, bs, dim**-0.5, wide)
    assert ((out.float() - wide).abs() <= wide.abs() / 2**8 + 1e-30).all()
    assert (out != wide.bfloat16()).sum() <= out.numel() // 5000


def test_kernel_rejects_a_shape_it_was_not_built_for() -> None:
    kernel = native.load(16, 2)
    assert kernel is not None
    q = torch.zeros(1, 4, 32)
    k = torch.zeros(2, 16, 32)
    with pytest.raises(ValueError, match="head_dim"):
        kernel(q, k, k, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1, 16, 1.0, q.clone())


def test_engine_uses_the_installed_kernels_and_says_so() -> None:
    loaded = from_config(tiny_config("llama"), dtype=torch.float32)
    backend = EngineCore(loaded, EngineConfig(kv_cache_tokens=256)).backend
    assert backend.kernel is not None and backend.fused is not None
    assert "compiled decode kernel" in backend.description and "fused" in backend.description
    assert EngineCore(loaded, EngineConfig(kv_cache_tokens=256, native_attention=False)).backend.kernel is None
    off = EngineCore(loaded, EngineConfig(kv_cache_tokens=256, cpu_kernels="off")).backend
    assert off.kernel is None and off.fused is None and "decode attention in torch" in off.description


def test_without_installed_kernels_auto_warns_once_and_require_refuses(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path
) -> None:  # noqa: ANN001
    loaded = from_config(tiny_config("llama"), dtype=torch.float32)
    monkeypatch.setattr(native, "LIBRARY_DIR", tmp_path)  # an install that could not compile them
    monkeypatch.setattr(native, "_libraries", {})
    monkeypatch.setattr(native, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        core = EngineCore(loaded, EngineConfig(kv_cache_tokens=256))
        EngineCore(loaded, EngineConfig(kv_cache_tokens=256))
    assert core.backend.kernel is None and core.backend.fused is None
    warnings = [r for r in caplog.records if "CPU kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "torch paths" in warnings[0].getMessage()
    with pytest.raises(native.KernelsMissing, match="require"):
        EngineCore(loaded, EngineConfig(kv_cache_tokens=256, cpu_kernels="require"))


def test_a_shape_without_a_compiled_kernel_decodes_in_torch() -> None:
    assert native.load(24, 3) is None  # head_dim 24 is not among the built pairs
    assert native.load(64, 3) is not None


def test_building_the_engine_never_runs_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels come built with the install: loading them afresh and building an engine starts no process."""
    import subprocess

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started at engine start: {args}")

    monkeypatch.setattr(native, "_libraries", {})
    monkeypatch.setattr(subprocess, "Popen", no_compiler)
    monkeypatch.setattr(subprocess, "run", no_compiler)
    backend = EngineCore(
        from_config(tiny_config("llama"), dtype=torch.float32), EngineConfig(kv_cache_tokens=256)
    ).backend
    assert backend.kernel is not None and backend.fused is not None
