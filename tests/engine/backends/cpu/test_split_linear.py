"""Float32 linears as three bfloat16 products on AMX tiles (split_linear.py, csrc/amx_ops.c): against float64, at
shapes the tiles do not divide, with and without bias and residual; each row's result the same alone, in any batch
and on any thread count; `--fp32-matmul` resolved by what the CPU has (capped by LLMSERVE_CPU_ISA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.engine.backends.cpu import split_linear
from llmserve.engine.backends.cpu.split_linear import Fp32Matmul, SplitLinear

UNAVAILABLE = split_linear.why_unavailable()
needs_amx = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"bf16x3 linears cannot run here: {UNAVAILABLE}")
# Measured ~4e-6 of the largest output; one bfloat16 product (what the split avoids) is ~2.5e-3.
RELATIVE_ERROR = 2e-5


def _case(rows: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


def _relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.double() - reference).abs().max() / reference.abs().max()).item()


@needs_amx
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [(1, 384, 384), (33, 40, 70), (512, 384, 1536), (100, 1536, 384), (70, 17, 33), (64, 768, 2304)],
)
def test_products_within_float32_reach(rows: int, k: int, n: int) -> None:
    x, w, b = _case(rows, k, n)
    reference = x.double() @ w.double().T + b.double()
    y = SplitLinear(w, b)(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    error = _relative_error(y, reference)
    assert error <= RELATIVE_ERROR, error
    # the split is what holds it there: the same weights in one bfloat16 product are ~100x further off
    assert _relative_error(F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()), reference) > 20 * error


@needs_amx
def test_no_bias_and_a_residual() -> None:
    x, w, _ = _case(45, 96, 64, seed=1)
    residual = torch.randn(45, 64)
    reference = x.double() @ w.double().T + residual.double()
    assert _relative_error(SplitLinear(w, None)(x, residual), reference) <= RELATIVE_ERROR
    with pytest.raises(ValueError, match="residual"):
        SplitLinear(w, None)(x, residual[:, :32])
    with pytest.raises(ValueError, match=r"float32 \[rows, 96\]"):
        SplitLinear(w, None)(x[:, :95])
    assert SplitLinear(w, None)(x[:0]).shape == (0, 64)


@needs_amx
def test_a_rows_result_depends_on_no_other_row_nor_the_threads() -> None:
    x, w, b = _case(200, 384, 1152, seed=2)
    linear = SplitLinear(w, b)
    whole = linear(x)
    for i in (0, 31, 32, 150, 199):
        assert torch.equal(linear(x[i : i + 1]), whole[i : i + 1])
    assert torch.equal(linear(x[17:90]), whole[17:90])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x), whole)
    finally:
        torch.set_num_threads(threads)


def test_ieee_is_kept_and_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Fp32Matmul.IEEE.resolve() is Fp32Matmul.IEEE
    expected = Fp32Matmul.BF16X3 if UNAVAILABLE is None else Fp32Matmul.IEEE
    assert Fp32Matmul.AUTO.resolve() is expected
    # Below AMX (as capped), auto is float32's own GEMM, and asking for the split says why it cannot run.
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "avx512_core_bf16")
    assert Fp32Matmul.AUTO.resolve() is Fp32Matmul.IEEE
    with pytest.raises(ValueError, match="bf16x3 cannot run here: it needs AMX-BF16"):
        Fp32Matmul.BF16X3.resolve()
