"""The fused CPU forward (fused_layers.py, csrc/fused_ops.c, csrc/mixed_ops.c) computes what transformers'
layers compute: float32 and float64 to their rounding, bfloat16 and int8 within theirs, every linear packed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.attention import Chunk, GatheredAttention, paged_attention
from llmserve.engine.backends.cpu import native
from llmserve.engine.backends.cpu.backend import CpuBackend
from llmserve.engine.backends.cpu.fused_layers import FusedForward
from llmserve.engine.backends.cpu.packed_linear import Int8Linear, PackedBF16, RefinedHead
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.models.loader import from_config
from tests.isa import dtype_param
from tests.testing import TINY_VOCAB, one_prompt_attention, tiny_config

OPS = native.load_fused()
assert OPS is not None, "the CPU kernels are not installed: run `make kernels`"
DTYPES = [torch.float32, torch.float64]
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> bool:
    return (a - b).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_equal_transformers_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g, dtype=dtype)
    x = torch.randn(37, 160, generator=g, dtype=dtype)[:, 10:106]  # rows with a stride, as q/k/v views have
    residual, delta = torch.randn(37, 96, generator=g, dtype=dtype), torch.randn(37, 96, generator=g, dtype=dtype)
    expected_sum = residual + delta
    with torch.inference_mode():
        # transformers' RMSNorm rounds through float32 even for float64 inputs; ours keeps the input's precision.
        scale = 1.0 if dtype == torch.float32 else 1e6
        assert close(OPS.rms_norm(x, norm.weight, 1e-5), norm(x), dtype, 10 * scale)
        out = OPS.add_rms_norm(residual, delta, norm.weight, 1e-5)
        assert torch.equal(residual, expected_sum)  # the residual stream is updated in place
        assert close(out, norm(expected_sum), dtype, 10 * scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_silu_mul_equal_transformers(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    tokens, heads, dim = 23, 5, 32
    qkv = torch.randn(tokens, heads * dim + 40, generator=g, dtype=dtype)
    rest = qkv[:, heads * dim :].clone()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    cos, sin = torch.randn(tokens, dim, generator=g, dtype=dtype), torch.randn(tokens, dim, generator=g, dtype=dtype)
    expected, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    OPS.rotary(q, cos, sin)
    assert torch.equal(q, expected[0].transpose(0, 1))
    assert torch.equal(qkv[:, heads * dim :], rest)  # the rest of the row is left alone
    gate_up = torch.randn(tokens, 2 * 48, generator=g, dtype=dtype) * 4
    assert close(OPS.silu_mul(gate_up), F.silu(gate_up[:, :48]) * gate_up[:, 48:], dtype, 10)


def test_fused_ops_reject_layouts_they_cannot_read() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        OPS.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        OPS.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="cos/sin"):
        OPS.rotary(x.view(4, 2, 4), torch.ones(4, 6), torch.ones(4, 6))
    with pytest.raises(ValueError, match="silu_mul"):
        OPS.silu_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="residual"):
        OPS.add_rms_norm(torch.randn(3, 8), x, torch.ones(8), 1e-6)


def prefill_logits(runner: CpuBackend, ids: torch.Tensor, fused: bool) -> torch.Tensor:
    """One sequence's whole prompt as one chunk, through the fused forward or the model's own."""
    tokens = ids.shape[1]
    batch = GatheredAttention(
        kv=runner.kv.tensor, slot_mapping=torch.arange(tokens), decode=[], chunks=[Chunk(0, tokens, None, None)]
    )
    positions = torch.arange(tokens)[None]
    with torch.inference_mode():
        if fused:
            return runner.fused.run(ids, positions, None, batch)[0]
        return runner.model(input_ids=ids, position_ids=positions, use_cache=False, llmserve_batch=batch).logits[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_fused_forward_gives_the_models_logits(family: str, dtype: torch.dtype) -> None:
    """Every supported family, float32 (packed oneDNN linears) and float64: the same logits for a prompt."""
    loaded = from_config(tiny_config(family), dtype=dtype)
    runner = create_backend(loaded, EngineConfig(block_size=16, kv_cache_tokens=256))
    assert isinstance(runner, CpuBackend)
    assert runner.fused is not None
    ids = torch.randint(TINY_VOCAB, (1, 101), generator=torch.Generator().manual_seed(2))
    fused, plain = prefill_logits(runner, ids, True), prefill_logits(runner, ids, False)
    assert fused.shape == plain.shape == (101, TINY_VOCAB)
    # float64 differs only where transformers' RMSNorm rounds through float32.
    assert close(fused, plain.float(), dtype, 1.0 if dtype == torch.float32 else 1e6)


def kernel_prefill_logits(runner: CpuBackend, ids: torch.Tensor) -> torch.Tensor:
    """One sequence's prompt through the fused forward as the bfloat16 and int8 backends attend: every token a
    query of the decode kernel over the context up to itself."""
    tokens = ids.shape[1]
    assert runner.kernel is not None and runner.fused is not None
    batch = one_prompt_attention(runner, tokens)
    with torch.inference_mode():
        return runner.fused.run(ids, torch.arange(tokens)[None], None, batch)[0]


@pytest.mark.parametrize("dtype", [dtype_param("bfloat16"), dtype_param("int8")])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bfloat16_and_int8_forwards_give_the_models_logits_within_their_rounding(family: str, dtype: str) -> None:
    """Against the model's own forward in float32 on the same (bfloat16) weights. Every linear is packed (a layer
    left on plain or dense weights, or a weight packed transposed, fails here), the KV cache is bfloat16, and the
    residual stream float32."""
    config = tiny_config(family)
    config.intermediate_size = 1536  # a down projection whose reduction bfloat16 splits (packed_linear)
    loaded = from_config(config, dtype=torch.bfloat16)
    loaded.weights = "int8" if dtype == "int8" else None
    reference = copy.deepcopy(loaded.model).float()
    runner = create_backend(loaded, EngineConfig(block_size=16, kv_cache_tokens=256))
    assert isinstance(runner, CpuBackend) and runner.fused is not None
    kind = PackedBF16 if dtype == "bfloat16" else Int8Linear
    head = runner.fused.lm_head
    assert isinstance(head, RefinedHead)  # its best candidates recomputed in float32
    linears = [head.head] + [getattr(ly, n) for ly in runner.fused.layers for n in ("qkv", "o", "gate_up", "down")]
    # In oneDNN's blocked layout: a dense weight computes the same logits, only slower.
    assert all(type(linear) is kind and linear.packed for linear in linears), linears
    assert runner.fused.num_packed == len(linears)
    assert runner.kv.tensor.dtype == torch.bfloat16
    ids = torch.randint(TINY_VOCAB, (1, 101), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = reference(input_ids=ids).logits[0]
    fused = kernel_prefill_logits(runner, ids)
    error = (fused - expected).abs().mean() / expected.abs().mean()
    assert error < {"bfloat16": 0.01, "int8": 0.03}[dtype], error


def test_fused_forward_applies_only_where_it_can() -> None:
    gpt2 = from_config(tiny_config("gpt2"), dtype=torch.float32)
    assert FusedForward.build(gpt2.model, OPS, pack=False, attention=paged_attention) is None
    gelu = tiny_config("llama")
    gelu.hidden_act = "gelu"
    model = from_config(gelu, dtype=torch.float32).model
    assert FusedForward.build(model, OPS, pack=False, attention=paged_attention) is None
    llama = from_config(tiny_config("llama"), dtype=torch.float32).model
    assert FusedForward.build(llama, None, pack=False, attention=paged_attention) is None  # no compiled ops
    assert FusedForward.build(llama.to(torch.bfloat16), OPS, pack=False, attention=paged_attention) is None


def test_engine_switch() -> None:
    on = EngineConfig(kv_cache_tokens=256)
    off = EngineConfig(kv_cache_tokens=256, fused_layers=False)
    assert EngineCore(from_config(tiny_config(), dtype=torch.float32), on).backend.fused is not None
    assert EngineCore(from_config(tiny_config(), dtype=torch.float32), off).backend.fused is None
