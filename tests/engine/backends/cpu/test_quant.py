"""GGUF block tensors: decoding equals the `gguf` package's numpy reference (which no one here wrote), the linear
equals dequantize-then-matmul in float64 within the bound its activation scheme implies, a row's result does not
depend on the rows beside it, and malformed tensors are refused with a message naming what is wrong."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmserve.engine.backends.cpu import quant
from llmserve.engine.backends.cpu.quant import GGMLType, QuantFormatError, QuantLinear, QuantWeight

BLOCK_TYPES = [t for t in GGMLType if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)]
# Types gguf.quants can quantize from floats; for the others (the K types) blocks are built from random bytes
# with valid float16 scales: every byte pattern of their quants and 6-bit sub-scales is a valid block.
QUANTIZABLE = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.BF16}
# Byte offsets of each block's float16 scales (d, dmin).
HALVES = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def make_weight(kind: GGMLType, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    """A random [rows, cols] tensor of `kind`, as a file would hold it."""
    rng = np.random.default_rng(seed)
    if kind in QUANTIZABLE or kind in (GGMLType.F32, GGMLType.F16):
        floats = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        raw = gguf.quants.quantize(floats, gguf.GGMLQuantizationType(int(kind)))
        data = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    else:
        per_block, nbytes = quant.block_size(kind), quant.row_bytes(kind, quant.block_size(kind))
        data = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
        for at in HALVES[kind]:
            scales = (rng.standard_normal(data.shape[0]) * 0.002).astype(np.float16)
            data[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
        data = data.reshape(rows, -1)
    return QuantWeight(kind, rows, cols, torch.from_numpy(data.copy()))


def reference(w: QuantWeight) -> np.ndarray:
    return gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType(int(w.kind))).reshape(w.rows, w.cols)


def cols_for(kind: GGMLType) -> int:
    """An odd number of blocks, so that nothing may assume pairs of them."""
    return 3 * quant.block_size(kind) if quant.block_size(kind) > 1 else 96


@pytest.mark.parametrize("kind", list(GGMLType), ids=lambda t: t.name)
def test_dequantize_equals_the_gguf_reference(kind: GGMLType) -> None:
    w = make_weight(kind, 7, 2 * cols_for(kind) if kind in BLOCK_TYPES else 160, seed=int(kind))
    expected = reference(w)
    got = quant.dequantize(w)
    assert got.dtype == torch.float32 and tuple(got.shape) == (w.rows, w.cols)
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("kind", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_dequantize_rows_decodes_the_rows_asked_for(kind: GGMLType) -> None:
    w = make_weight(kind, 9, cols_for(kind))
    ids = torch.tensor([[8, 0], [3, 3]])
    np.testing.assert_array_equal(quant.dequantize_rows(w, ids).numpy(), reference(w)[[8, 0, 3, 3]])
    with pytest.raises(IndexError, match=r"\[0, 9\)"):
        quant.dequantize_rows(w, torch.tensor([9]))


def error_bound(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The most |x @ w.T - float64 reference| may be when each activation is rounded to a step of
    max |x| / 127 over its block of 32 (int8 activations, llama.cpp's Q8_0 scheme), plus float32 rounding:
    half a step times sum |w| per block, plus 2^-20 of sum |w x| for each block summed."""
    rows, cols = x.shape
    step = x.abs().reshape(rows, cols // 32, 32).amax(-1) / 127  # [M, blocks]
    wsum = w.abs().reshape(w.shape[0], cols // 32, 32).sum(-1)  # [N, blocks]
    activation = 0.5 * step @ wsum.T
    rounding = (x.abs() @ w.abs().T) * (cols // 32 + 4) * 2.0**-20
    return activation + rounding


@pytest.mark.parametrize("kind", list(GGMLType), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 32, 300])
def test_linear_equals_dequantize_then_matmul(kind: GGMLType, m: int) -> None:
    w = make_weight(kind, 37, cols_for(kind), seed=m)
    x = torch.randn(m, w.cols, generator=torch.Generator().manual_seed(m))
    linear = QuantLinear(w)
    assert (linear.out_features, linear.in_features) == (37, w.cols)
    got = linear(x)
    dense = torch.from_numpy(reference(w)).double()
    expected = x.double() @ dense.T
    assert got.dtype == torch.float32 and tuple(got.shape) == (m, 37)
    err = (got.double() - expected).abs()
    bound = error_bound(dense, x.double())
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3f}"


@pytest.mark.parametrize("kind", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K])
def test_a_row_gives_the_same_bits_whatever_rows_share_its_call(kind: GGMLType) -> None:
    w = make_weight(kind, 19, cols_for(kind))
    linear = QuantLinear(w)
    x = torch.randn(300, w.cols, generator=torch.Generator().manual_seed(1))
    everything = linear(x)
    for start, count in ((0, 1), (5, 1), (299, 1), (3, 4), (10, 32), (0, 299), (1, 257)):
        part = linear(x[start : start + count].contiguous())
        assert torch.equal(part, everything[start : start + count]), (start, count)


def test_malformed_weights_are_refused_naming_what_is_wrong() -> None:
    good = make_weight(GGMLType.Q4_0, 4, 64)
    with pytest.raises(QuantFormatError, match=r"\[4, 36\].*got \[4, 35\]"):
        QuantWeight(GGMLType.Q4_0, 4, 64, good.data[:, :35])
    with pytest.raises(QuantFormatError, match=r"\[5, 36\]"):
        QuantWeight(GGMLType.Q4_0, 5, 64, good.data)
    with pytest.raises(QuantFormatError, match="not a whole number of 32-blocks"):
        QuantWeight(GGMLType.Q4_0, 4, 48, good.data)
    with pytest.raises(QuantFormatError, match="GGML type id 10 is not supported"):
        QuantWeight(10, 4, 64, good.data)  # type: ignore[arg-type]  # Q2_K, as a file may hold it
    with pytest.raises(QuantFormatError, match="uint8"):
        QuantWeight(GGMLType.Q4_0, 4, 64, good.data.float())
    with pytest.raises(QuantFormatError, match="contiguous"):
        QuantWeight(GGMLType.Q4_0, 4, 32, good.data[:, :18])


def test_input_of_the_wrong_shape_or_dtype_is_refused() -> None:
    linear = QuantLinear(make_weight(GGMLType.Q8_0, 4, 64))
    with pytest.raises(ValueError, match=r"float32 \[rows, 64\]"):
        linear(torch.zeros(2, 32))
    with pytest.raises(ValueError, match=r"float32 \[rows, 64\]"):
        linear(torch.zeros(2, 64, dtype=torch.float64))


def test_a_weight_may_be_a_read_only_view_of_a_file(tmp_path) -> None:  # noqa: ANN001
    w = make_weight(GGMLType.Q4_1, 6, 64)
    path = tmp_path / "tensor.bin"
    w.data.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=w.data.numel(), dtype=torch.uint8).reshape(6, -1)
    view = QuantWeight(GGMLType.Q4_1, 6, 64, mapped)
    x = torch.randn(3, 64)
    assert torch.equal(QuantLinear(view)(x), QuantLinear(w)(x))
    assert torch.equal(mapped, w.data)  # never written to
