"""GGUF block tensors: decoding equals the `gguf` package's numpy reference (which no one here wrote), the linear
equals dequantize-then-matmul in float64 within the bound its activation scheme implies, a row's result does not
depend on the rows beside it, and malformed tensors are refused with a message naming what is wrong."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmserve import cpu_features
from llmserve.engine.backends.cpu import quant
from llmserve.engine.backends.cpu.quant import GGMLType, QuantFormatError, QuantKernelError, QuantLinear, QuantWeight

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


# The levels this CPU runs, decided from its flags without the function under test, so that a broken
# `levels_here` fails a test instead of skipping the levels.
_FLAGS = cpu_features.cpu_flags()
_AVX2 = {"avx2", "fma", "f16c"} <= _FLAGS
LEVELS_HERE = [
    level
    for level, runs in (
        ("portable", True),
        ("avx2", _AVX2),
        ("avx2-vnni", _AVX2 and "avx_vnni" in _FLAGS),
        ("avx512-vnni", _AVX2 and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= _FLAGS),
    )
    if runs
]


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
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 9, 32, 300])
def test_linear_equals_dequantize_then_matmul(kind: GGMLType, m: int) -> None:
    """At the level this CPU picks; the other levels give the same bits (next test)."""
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


def test_the_levels_here_are_the_ones_the_cpu_reports() -> None:
    assert list(quant.levels_here()) == LEVELS_HERE


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 4, 9, 300])
def test_float_activations_equal_dequantize_then_matmul_within_float32_rounding(kind: GGMLType, m: int) -> None:
    """activations="float32": the weights decoded exactly as `dequantize`, so float32 summation alone separates
    the result from float64 (each output sums 1/4 of k in a chain: at most ~k/4 roundings of its running sum)."""
    w = make_weight(kind, 37, cols_for(kind), seed=m)
    x = torch.randn(m, w.cols, generator=torch.Generator().manual_seed(m))
    dense = torch.from_numpy(reference(w)).double()
    err = (QuantLinear(w, activations="float32")(x).double() - x.double() @ dense.T).abs()
    bound = (x.double().abs() @ dense.abs().T) * (w.cols / 4 + 2) * 2.0**-24
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3f}"


@pytest.mark.parametrize("activations", quant.ACTIVATIONS)
@pytest.mark.parametrize("level", LEVELS_HERE[1:])
@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda t: t.name)
def test_every_level_gives_the_portable_kernels_bits(kind: GGMLType, level: str, activations: str) -> None:
    """Rows 1 to 11 cover every row tile of the vector kernels (8, 4 and 2 rows) and their remainders, and rows 8 to
    27 the float rows eight to a vector: whole vectors, a last vector padded (12, 20), rows left over after them
    (9, 17) and a row vector alone (24: two, then one); 45 columns a partial last strip; 3 blocks of 256 more than
    one group of decoded blocks (8 of 32)."""
    w = make_weight(kind, 45, 768, seed=7)
    x = torch.randn(27, w.cols, generator=torch.Generator().manual_seed(2))
    portable, vector = QuantLinear(w, "portable", activations), QuantLinear(w, level, activations)
    for m in range(1, 28):
        assert torch.equal(vector(x[:m]), portable(x[:m])), m


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_activations_are_quantized_as_llama_cpps_q8_0_bit_for_bit(level: str) -> None:
    """The int8 activations are llama.cpp's (the gguf package's Q8_0 quantize, bit-exact with ggml-quants.c): read
    back through a Q8_0 identity weight, where output c is a_c * dx * d (exactly recoverable: |a_c| <= 127), for
    random rows and rows built to round at ties (x / d = k + 1/2: away from zero, where round-to-even or a
    truncation gives other quants; the float64 error bound of the linear tests would pass either)."""
    k = 128
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(k).astype(np.float32) * scale for scale in (1.0, 1e-3, 30.0)]
    ties = np.tile(np.arange(-63, 65, dtype=np.float32) + 0.5, 1)[:k]  # every x / d a half: d = 127 / 127 = 1
    ties[::32] = 127.0  # each block's largest, so d = 1 exactly
    rows += [ties, -ties, np.where(np.arange(k) % 2, ties, ties / 3).astype(np.float32)]
    x = np.stack(rows)
    blocks = gguf.quants.quantize(np.eye(k, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    identity = QuantWeight(GGMLType.Q8_0, k, k, torch.from_numpy(blocks))
    y = QuantLinear(identity, level, "int8")(torch.from_numpy(x)).double().numpy()
    w_scale = np.float64(np.float16(1 / 127))  # the identity's block scale (its quants are 127)
    dx = np.abs(x.reshape(len(rows), k // 32, 32)).max(-1).astype(np.float32) / np.float32(127)
    got = np.rint(y / (127 * w_scale * np.repeat(dx.astype(np.float64), 32, axis=1))).astype(np.int64)
    reference = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(len(rows), k // 32, 34)[..., 2:]
    expected = reference.view(np.int8).reshape(len(rows), k).astype(np.int64)
    assert (got == expected).all(), np.argwhere(got != expected)[:5]


def _invariant(linear: QuantLinear, x: torch.Tensor) -> None:
    everything = linear(x)
    # float rows: 1 row and Q8_0's 2 to 7 straight from the blocks, 2 rows of the other types the one-row path
    # twice, 3 and more the tiles
    last = x.shape[0] - 1
    for start, count in ((0, 1), (5, 1), (last, 1), (7, 2), (3, 4), (11, 5), (20, 7), (10, 32), (0, last), (1, 257)):
        part = linear(x[start : start + count].contiguous())
        assert torch.equal(part, everything[start : start + count]), (start, count)


@pytest.mark.parametrize("activations", quant.ACTIVATIONS)
@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("kind", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K])
def test_a_row_gives_the_same_bits_whatever_rows_share_its_call(kind: GGMLType, level: str, activations: str) -> None:
    w = make_weight(kind, 19, cols_for(kind))
    x = torch.randn(300, w.cols, generator=torch.Generator().manual_seed(1))
    _invariant(QuantLinear(w, level, activations), x)


@pytest.mark.parametrize("kind", [GGMLType.F32, GGMLType.F16, GGMLType.BF16])
def test_float_types_keep_batch_invariance_too(kind: GGMLType) -> None:
    w = make_weight(kind, 19, 96)
    _invariant(QuantLinear(w), torch.randn(300, w.cols, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("activations", quant.ACTIVATIONS)
def test_results_do_not_depend_on_the_thread_count(activations: str) -> None:
    w = make_weight(GGMLType.Q4_K, 200, 512)  # 13 strips, split unevenly
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))
    linear = QuantLinear(w, activations=activations)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            assert torch.equal(linear(x), one), threads
    finally:
        torch.set_num_threads(before)


def test_out_writes_only_its_columns_of_a_wider_output() -> None:
    first, second = make_weight(GGMLType.Q4_K, 21, 256), make_weight(GGMLType.Q6_K, 19, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    wide = torch.full((5, 50), 7.0)
    QuantLinear(first)(x, out=wide[:, 3:24])
    QuantLinear(second)(x, out=wide[:, 24:43])
    assert torch.equal(wide[:, 3:24], QuantLinear(first)(x)) and torch.equal(wide[:, 24:43], QuantLinear(second)(x))
    assert bool((wide[:, :3] == 7).all()) and bool((wide[:, 43:] == 7).all())
    with pytest.raises(ValueError, match=r"out must be float32 \[5, 21\]"):
        QuantLinear(first)(x, out=torch.empty(5, 22))


def test_a_non_finite_input_reaches_only_its_own_row() -> None:
    linear = QuantLinear(make_weight(GGMLType.Q8_0, 9, 64))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    x[1, 40] = float("nan")
    y = linear(x)
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())
    assert torch.equal(y[[0, 2]], linear(x[[0, 2]]))


def test_tiny_and_huge_inputs_stay_finite_and_within_the_bound() -> None:
    """Blocks whose largest value is subnormal (the reciprocal of the activation scale overflows float32) or near
    float32's largest; zero rows give zeros. Subnormal values carry few bits, so there the bound is absolute: far
    below the smallest normal float32 (1.2e-38)."""
    w = make_weight(GGMLType.Q8_0, 9, 96)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(8))
    x[0] *= 1e-40
    x[1] *= 1e36
    x[2] = 0
    y = QuantLinear(w)(x)
    assert bool(y[[0, 1, 3]].isfinite().all()) and bool((y[2] == 0).all())
    dense = torch.from_numpy(reference(w)).double()
    err = (y.double() - x.double() @ dense.T).abs()
    assert bool((err <= error_bound(dense, x.double()) + 1e-39).all())


def test_no_rows_give_no_rows() -> None:
    assert QuantLinear(make_weight(GGMLType.Q4_K, 5, 256))(torch.empty(0, 256)).shape == (0, 5)


@pytest.mark.parametrize(
    ("cap", "level"),
    [("none", "portable"), ("avx2", "avx2"), ("avx512_core", "avx2"), ("avx512_core_vnni", "avx512-vnni")],
)
def test_the_level_follows_the_cpu_cap(monkeypatch: pytest.MonkeyPatch, cap: str, level: str) -> None:
    if level not in LEVELS_HERE:
        pytest.skip(f"this CPU does not run {level}")
    monkeypatch.setenv(cpu_features.ENV, cap)
    assert quant.kernel_level() == level
    assert QuantLinear(make_weight(GGMLType.Q4_0, 3, 32)).level == level


def test_an_unknown_level_or_activation_scheme_is_refused() -> None:
    w = make_weight(GGMLType.Q4_0, 3, 32)
    with pytest.raises(QuantKernelError, match="'avx9'"):
        QuantLinear(w, "avx9")
    with pytest.raises(ValueError, match="'int4'"):
        QuantLinear(w, activations="int4")


def test_the_torch_level_computes_in_float32_from_the_blocks() -> None:
    """The path without the compiled library: float activations, so float32 rounding alone."""
    w = make_weight(GGMLType.Q4_1, 11, 96)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(6))
    expected = x.double() @ torch.from_numpy(reference(w)).double().T
    torch.testing.assert_close(QuantLinear(w, "torch")(x).double(), expected, rtol=1e-5, atol=1e-6)


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
