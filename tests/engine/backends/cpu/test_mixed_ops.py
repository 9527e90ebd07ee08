"""The fused row operations over bfloat16 and int8-quantized rows (csrc/mixed_ops.c through native.MixedOps)
compute what torch computes in float32, round as torch rounds, and give a row the same result in any batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llmserve.engine.backends.cpu import native

OPS = native.load_mixed()
assert OPS is not None, "the CPU kernels are not installed: run `make kernels`"
OUTPUTS = [torch.float32, torch.bfloat16, torch.uint8]


def values(rows: native.Rows) -> torch.Tensor:
    """The float32 values that rows of any format stand for."""
    if isinstance(rows, native.QuantizedRows):
        return (rows.values.float() - 128) * rows.scales[:, None]
    return rows.float()


def reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def tolerance(out: torch.dtype, scale: torch.Tensor) -> float:
    """What the output format's rounding allows: half a step of bfloat16, or of the row's int8 grid."""
    top = float(scale.abs().max())
    return {torch.float32: 1e-5 * top, torch.bfloat16: top / 2**8, torch.uint8: top / 127 * 0.51}[out]


def test_bfloat16_rounding_is_torchs() -> None:
    """Ties to even, infinities, values near the largest bfloat16, 30 decades: the C rounding equals
    .to(bfloat16) bit for bit (a NaN stays a NaN; its payload is not compared)."""
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3895e38, 1.00390625, 1.01171875, 1e-40])
    x = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-30, 30, (4096,), generator=g), special])
    rows = x.view(1, -1)
    out = OPS.convert(rows, torch.bfloat16)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out.view(torch.int16), rows.to(torch.bfloat16).view(torch.int16))
    nan = OPS.convert(torch.tensor([[float("nan")]]), torch.bfloat16)
    assert isinstance(nan, torch.Tensor) and nan.isnan().all()


@pytest.mark.parametrize("out", OUTPUTS)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_norms_equal_float32_math(src: torch.dtype, out: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, generator=g)
    x = torch.randn(37, 160, generator=g).to(src)[:, 10:106]  # rows with a stride, as q/k/v views have
    expected = reference_norm(x, w, 1e-5)
    assert (values(OPS.rms_norm(x, w, 1e-5, out)) - expected).abs().max() <= tolerance(out, expected)
    residual = torch.randn(37, 96, generator=g)
    delta = torch.randn(37, 96, generator=g).to(src)
    summed = residual + delta.float()
    normed = OPS.add_rms_norm(residual, delta, w, 1e-5, out)
    assert torch.equal(residual, summed)  # the float32 residual stream, updated in place
    expected = reference_norm(summed, w, 1e-5)
    assert (values(normed) - expected).abs().max() <= tolerance(out, expected)


@pytest.mark.parametrize("out", OUTPUTS)
def test_silu_mul_and_convert_equal_float32_math(out: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(23, 2 * 48, generator=g) * 4).bfloat16()
    expected = F.silu(gate_up[:, :48].float()) * gate_up[:, 48:].float()
    assert (values(OPS.silu_mul(gate_up, out)) - expected).abs().max() <= tolerance(out, expected)
    x, row_scale, bias = torch.randn(23, 40, generator=g), torch.rand(23, generator=g), torch.randn(40, generator=g)
    expected = x * row_scale[:, None] + bias
    assert (values(OPS.convert(x, out, row_scale, bias)) - expected).abs().max() <= tolerance(out, expected)


def test_quantized_rows_use_the_whole_int8_range_per_row() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1.0, -299.0]])
    q = OPS.convert(x, torch.uint8)
    assert isinstance(q, native.QuantizedRows)
    assert q.values[0].tolist() == [128 + 64, 128 - 127, 128 + 32] and q.scales[0] == pytest.approx(2 / 127)
    assert q.values[1].tolist() == [128, 128, 128] and q.scales[1] == 1.0  # a zero row: scale 1, not a division by 0
    assert q.values[2].tolist() == [255, 128, 1]


def test_rotary_in_bfloat16_rounds_once() -> None:
    g = torch.Generator().manual_seed(3)
    tokens, heads, dim = 11, 3, 32
    qkv = torch.randn(tokens, heads * dim + 8, generator=g).bfloat16()
    rest = qkv[:, heads * dim :].clone()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    cos, sin = torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g)
    wide = q.float().transpose(0, 1)[None]
    expected, _ = apply_rotary_pos_emb(wide, wide, cos[None], sin[None])
    OPS.rotary(q, cos, sin)
    assert torch.equal(q, expected[0].transpose(0, 1).bfloat16())
    assert torch.equal(qkv[:, heads * dim :], rest)


@pytest.mark.parametrize("out", OUTPUTS)
def test_a_row_gives_the_same_alone_and_in_a_batch(out: torch.dtype) -> None:
    """Batch invariance: enough rows to run on every thread, and each alone, bit for bit."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(576, generator=g)
    x = torch.randn(300, 576, generator=g).bfloat16()
    together = values(OPS.rms_norm(x, w, 1e-5, out))
    alone = torch.cat([values(OPS.rms_norm(x[i : i + 1], w, 1e-5, out)) for i in range(0, 300, 7)])
    assert torch.equal(together[::7], alone)


def test_mixed_ops_reject_what_they_cannot_read() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        OPS.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6, torch.bfloat16)
    with pytest.raises(ValueError, match="float32/bfloat16 rows"):
        OPS.rms_norm(x.double(), torch.ones(8), 1e-6, torch.bfloat16)
    with pytest.raises(ValueError, match="residual"):
        OPS.add_rms_norm(torch.randn(4, 8).bfloat16(), x, torch.ones(8), 1e-6, torch.bfloat16)
    with pytest.raises(ValueError, match="rotary"):
        OPS.rotary(x.view(4, 2, 4), torch.ones(4, 4), torch.ones(4, 4))
    with pytest.raises(ValueError, match="row format"):
        OPS.silu_mul(x, torch.float16)
