"""GGUF tensors kept as the file holds them (llama.cpp's block types), and linears computed from their blocks.

The seam between the GGUF loader and the kernels: a `QuantWeight` is one 2-D tensor's bytes as the file stores them
(llama.cpp's ggml-common.h layouts), `dequantize` the float32 reference (bitwise equal to the `gguf` package's numpy
decoders), `QuantLinear` computes x @ W.T from the blocks with the compiled kernels of csrc/quant*.c.

How (csrc/quant.h has the layout and the exact arithmetic): at construction the blocks are packed once into strips
of 16 output columns laid out for VNNI dot products (about the file's size: 4.5 bits a weight for Q4_0, 4.6 for
Q4_K, 6.6 for Q6_K, 8.5 for Q8_0); on each call the activations are quantized per block of 32 to int8 with one
float scale each (llama.cpp's Q8_0 scheme), each block's products are summed exactly in int32 (VPDPBUSD), and each
output accumulates its blocks' sums, scaled, in one fixed sequence of float operations. Rows are split from the
columns' side across threads. So a row's result is bitwise the same whatever M, whatever the other rows and the
thread count (batch invariance), and at every level: `avx512-vnni`, `avx2-vnni` (AVX-VNNI), `avx2` (VPMADDUBSW),
`portable` (C), compiled into one library with per-level target pragmas and picked at run time (`kernel_level`).

Tolerance of the scheme: activations are rounded to a step of max|x| / 127 of their block of 32, so for each output
|y - x @ W.T| <= sum over blocks of (step / 2) * sum |w| of the block, plus float32 rounding (tests/.../test_quant.py
checks that bound against float64). On the default model's own weights and activations (probe
benchmarks/probes/quant_activation_error.py, 256 tokens) the relative error of a linear is 0.6-1.7% (attn_v up to
3%), float32 torch's 3e-7; the LM head's argmax is unchanged on 98% of tokens given the same hidden states. Greedy
tokens therefore drift from the float32 path's after a while, as llama.cpp's do (it quantizes activations the same
way; its K-type dot products use one scale per 256, coarser than ours).

Why this scheme and our own kernels, measured (benchmarks/probes/quant_linear.py; one decoder layer's qkv, o,
gate_up and down, copies of the layer in turn so that weights come from memory; 1 thread, CPU time of the calling
thread, least of 7-9 rounds, on the shared 2-core Xeon with AVX512-VNNI and AMX, oneDNN capped at avx512_core_vnni
for the int8 yardstick; ms per layer):

    SmolLM2-135M (K = 576/1536)  M=1    M=4    M=32   M=256      Llama-3.2-1B shape   M=1    M=4    M=32   M=256
    float32 oneDNN (yardstick)   1.49   1.50   3.19   15.6       float32 oneDNN       18.9   19.5   45.5   222
    int8 oneDNN, per-row scales  0.61   0.67   1.39   6.2 (AMX)  int8 oneDNN (VNNI)   6.21   6.86   14.8   78.3
    torch int4pack, bf16 acts    0.32   0.50   3.54   26.8       torch int4pack bf16  4.60   7.26   52.6   417
    Q4_0                         0.235  0.337  1.41   11.7       Q4_0                 3.25   4.18   16.1   123
    Q4_1                         0.261  0.345  1.51   12.1       Q4_K                 3.22   4.05   17.1   136
    Q5_0                         0.278  0.370  1.47   11.9       Q5_K                 3.72   4.61   18.2   145
    Q8_0                         0.354  0.435  1.52   11.1       Q6_K                 4.62   5.36   21.9   165
                                                                 Q8_0                 5.18   6.61   18.6   125

At one to four rows a call streams its weights: 8.5-12.5 GB/s on one core (float32's 9-13 GB/s moves 5-7x the
bytes), 5-6x faster than float32 (a Llama-3-8B-shaped layer in Q4_K: 11.7 ms at one row, 10.8 GB/s). At 32 and 256
rows it is compute-bound: 150-160 GFLOP/s on SmolLM2's narrow shapes, 180-250 on the 1B shape's, 1.3-2.7x float32.
oneDNN's int8 (per-row activation scales, one float step per row instead of one per block of 32) is faster at 256
rows, but per-row scales cost SmolLM2 8% perplexity and it has no block-quantized weights. The lower levels, same
1B layer in Q4_K: avx2-vnni 3.49 / 5.28 / 26.9 / 202 ms, avx2 3.52 / 7.00 / 46.0 / 369 (at one row every level
streams the same bytes). torch's `_weight_int4pack_mm_for_cpu` represents Q4_0/Q4_1/Q4_K exactly but is fast only
with bfloat16 activations and then 2.3-3x slower than these kernels from 32 rows (with float32 activations 20-200x
slower); `_weight_int8pack_mm` has per-channel scales only; torchao's CPU int4 layout (Int4CPULayout) calls that
same aten op, and its other CPU kernels need its C++ extension built for the installed torch (not measured). With
float activations our own kernel is bound by float FMAs from 32 rows (below).

Float activations, for exactness (`QuantLinear(w, activations="float32")`): the blocks are decoded in the kernel to
the float32 weights `dequantize` gives, bit for bit, and each output sums x * w in float32 in a fixed order (four
partial sums by k mod 4), so the result is x @ dequantize(w).T up to float32 rounding, again the same at every level
and row count. Measured as above (ms per layer, 1B shape, Q4_K, 1 thread): M=1 5.2, M=4 7.5, M=32 34.8 (112
GFLOP/s), M=256 284 (110 GFLOP/s); float32 oneDNN 19.0 /
20.9 / 45.1 / 213; int8 activations 3.3 / 4.3 / 16.9 / 133. So at one to four rows it still beats float32 3-4x,
from 32 rows it is about float32's speed: int8 is the default, float32 the choice where tokens must equal the
float32 path's.

The float types (F32, F16, BF16) are widened once to float32 and run packed_linear's float32 linear.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from llmserve import cpu_features
from llmserve.engine.backends.cpu import native, packed_linear
from llmserve.engine.backends.cpu.packed_linear import Linear, make_linear


class GGMLType(enum.IntEnum):
    """The ggml tensor types these kernels compute, by GGUF's numeric ids (the gguf package's GGMLQuantizationType).
    Their block layouts come from the one table of block types, the gguf package's GGML_QUANT_SIZES (weights per
    block, bytes per block, as ggml's type traits give them), which the file reader sizes every tensor by too
    (models/gguf_file.py)."""

    F32 = GGMLQuantizationType.F32.value
    F16 = GGMLQuantizationType.F16.value
    Q4_0 = GGMLQuantizationType.Q4_0.value
    Q4_1 = GGMLQuantizationType.Q4_1.value
    Q5_0 = GGMLQuantizationType.Q5_0.value
    Q5_1 = GGMLQuantizationType.Q5_1.value
    Q8_0 = GGMLQuantizationType.Q8_0.value
    Q4_K = GGMLQuantizationType.Q4_K.value
    Q5_K = GGMLQuantizationType.Q5_K.value
    Q6_K = GGMLQuantizationType.Q6_K.value
    BF16 = GGMLQuantizationType.BF16.value


SUPPORTED: frozenset[GGMLType] = frozenset(GGMLType)


def _layout(kind: GGMLType) -> tuple[int, int]:
    """(weights per block, bytes per block) of `kind`."""
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    return per_block, nbytes


class QuantFormatError(ValueError):
    """A tensor's type or bytes do not make a valid QuantWeight; the message names what is wrong."""


def block_size(kind: GGMLType) -> int:
    """Weights per block of `kind` (1 for the float types)."""
    return _layout(_kind(kind))[0]


def row_bytes(kind: GGMLType, cols: int) -> int:
    """Bytes of one row of `cols` weights in `kind`. Raises QuantFormatError when `cols` is not a whole number of
    blocks."""
    per_block, nbytes = _layout(_kind(kind))
    if cols <= 0 or cols % per_block:
        raise QuantFormatError(f"{kind.name}: a row of {cols} weights is not a whole number of {per_block}-blocks")
    return cols // per_block * nbytes


def _kind(kind: int) -> GGMLType:
    try:
        result = GGMLType(kind)
    except ValueError:
        raise QuantFormatError(f"GGML type id {int(kind)} is not supported (supported: {_names()})") from None
    if result not in SUPPORTED:
        raise QuantFormatError(f"GGML type {result.name} is not supported (supported: {_names()})")
    return result


def _names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED))


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """One 2-D tensor as the file holds it: `rows` (GGUF ne[1], output features) rows of `cols` (ne[0], input
    features) weights, each row `row_bytes(kind, cols)` bytes of `kind`'s blocks. `data` is uint8
    [rows, row_bytes] with contiguous rows; it may be a read-only view of a memory-mapped file and is never
    written to. Raises QuantFormatError for an unsupported type or bytes that do not match the shape."""

    kind: GGMLType
    rows: int
    cols: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _kind(self.kind))
        if self.rows <= 0:
            raise QuantFormatError(f"{self.kind.name} tensor: rows must be positive, got {self.rows}")
        width = row_bytes(self.kind, self.cols)
        data = self.data
        if data.dtype != torch.uint8 or data.device.type != "cpu":
            raise QuantFormatError(f"{self.kind.name} tensor: data must be CPU uint8, got {data.dtype} {data.device}")
        if tuple(data.shape) != (self.rows, width):
            raise QuantFormatError(
                f"{self.kind.name} tensor of {self.rows}x{self.cols}: data must be [{self.rows}, {width}] bytes "
                f"({self.rows * width} in all), got {list(data.shape)} ({data.numel()})"
            )
        if data.stride(1) != 1 or (self.rows > 1 and data.stride(0) != width):
            raise QuantFormatError(f"{self.kind.name} tensor: data rows must be contiguous, strides {data.stride()}")


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The weights as float32 [rows, cols]: each block decoded as llama.cpp's dequantize_row_* does."""
    return _decode(w.kind, w.data, w.cols)


def dequantize_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (an integer tensor of row indices, any shape flattened) as float32 [len(ids), cols]: an embedding
    lookup that decodes only the rows asked for. Raises IndexError for an id outside [0, rows)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
    flat = ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.rows):
        raise IndexError(f"row ids must lie in [0, {w.rows}), got {int(flat.min())}..{int(flat.max())}")
    return _decode(w.kind, w.data.index_select(0, flat), w.cols)


class QuantLinear:
    """y = x @ W.T from W's blocks: x float32 [M, in_features] (rows contiguous) -> float32 [M, out_features].

    A row's result is bitwise the same whatever the other rows of the call, whatever M and whatever the thread
    count (batch invariance), and, for the block types, the same at every kernel level. Block types run the
    compiled kernel of `level` (default: kernel_level()) on a copy of the blocks packed for it (`nbytes` of
    them; the QuantWeight's bytes are not kept, so a caller may release its mapping), with `activations` "int8"
    (quantized per block of 32: the fast default) or "float32" (the weights decoded exactly as `dequantize`
    gives them, float32 sums: x @ dequantize(w).T up to float32 rounding, at about half the speed; see the
    module docstring). The float types (F32, F16,
    BF16) are widened once to float32 and run the float32 linear of packed_linear. Without the compiled library,
    the block types dequantize on each call and multiply one row at a time in float32 (level "torch").
    """

    __slots__ = (
        "kind",
        "out_features",
        "in_features",
        "nbytes",
        "level",
        "_packed",
        "_dense",
        "_weight",
        "_fn",
        "_args",
    )

    def __init__(self, w: QuantWeight, level: str | None = None, activations: str = "int8") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.kind = w.kind
        self.out_features = w.rows
        self.in_features = w.cols
        self._packed: torch.Tensor | None = None
        self._dense: Linear | None = None
        self._weight: QuantWeight | None = None
        self._fn: Any = None  # the bound C function and its leading arguments: a decode step makes ~100 calls
        self._args: tuple[int, ...] = ()
        if w.kind in FLOAT_TYPES:
            dense = dequantize(w)
            self._dense = make_linear(
                dense, None, "float32", packed_linear.available(dense.device, dense.dtype), None, torch.float32
            )
            self.level = "float32"
            self.nbytes = dense.numel() * 4
            return
        self.level = kernel_level() if level is None else level
        lib = _library()
        if self.level == "torch" or lib is None:
            if self.level != "torch":
                raise QuantKernelError(f"kernel level {self.level!r} needs the compiled library {LIBRARY}")
            self._weight = w
            self.nbytes = w.data.numel()
            return
        if self.level not in levels_here():
            raise QuantKernelError(f"kernel level {self.level!r} cannot run on this CPU (it runs {levels_here()})")
        size = lib.quant_packed_bytes(int(w.kind), w.rows, w.cols)
        packed = torch.empty(size, dtype=torch.uint8)
        failed = lib.quant_pack(
            int(w.kind), w.data.data_ptr(), row_bytes(w.kind, w.cols), w.rows, w.cols, packed.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise QuantFormatError(f"{w.kind.name} {w.rows}x{w.cols}: the kernels cannot pack this tensor")
        self._packed = packed
        self.nbytes = size
        self._fn = lib.quant_linear if activations == "int8" else lib.quant_linear_f32
        self._args = (LEVELS.index(self.level), int(w.kind), packed.data_ptr(), w.rows, w.cols)

    def kernel_args(self) -> tuple[int, int, int, int, int] | None:
        """The compiled kernel's leading arguments (level, type, packed blocks' address, out and in features), for
        a caller in C; None where this linear runs no compiled block kernel (a float type, the torch level)."""
        if self._fn is None:
            return None
        level, kind, packed, rows, cols = self._args
        return level, kind, packed, rows, cols

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T, written into `out` when given (float32 [M, out_features] with contiguous rows, e.g. a column
        slice of a wider output) and returned."""
        _check_input(x, self.in_features)
        m = x.shape[0]
        if out is None:
            if self._dense is not None:
                return self._dense(x)
            out = torch.empty(m, self.out_features, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.shape != (m, self.out_features) or out.stride(1) != 1:
            raise ValueError(f"out must be float32 [{m}, {self.out_features}] with contiguous rows")
        if self._fn is not None:
            failed = self._fn(*self._args, x.data_ptr(), m, out.data_ptr(), out.stride(0), torch.get_num_threads())
            if failed:
                raise QuantKernelError(f"quant_linear failed ({_FAILURES.get(failed, failed)})")
        elif self._dense is not None:
            out.copy_(self._dense(x))
        else:
            assert self._weight is not None
            w = dequantize(self._weight)
            for i in range(m):  # one row at a time: the same kernel for a row whatever M
                out[i] = F.linear(x[i : i + 1], w)[0]
        return out


def kernel_level() -> str:
    """The kernel level QuantLinear's block types run here, one of LEVELS, or "torch" without the compiled library.

    From this CPU's level as cpu_features gives it, capped by LLMSERVE_CPU_ISA: "avx512-vnni" from
    avx512_core_vnni up; "avx2-vnni" on an AVX2 CPU with AVX-VNNI (uncapped: a cap to avx2 means a CPU of plain
    AVX2, as oneDNN's avx2 excludes AVX-VNNI too); "avx2"; else "portable".
    """
    here = levels_here()
    if not here:
        return "torch"
    level = cpu_features.cpu_level()
    if cpu_features.at_least(level, "avx512_core_vnni") and "avx512-vnni" in here:
        return "avx512-vnni"
    if cpu_features.at_least(level, "avx2"):
        uncapped = level == cpu_features.detected_level(cpu_features.cpu_flags())
        return "avx2-vnni" if uncapped and "avx2-vnni" in here else "avx2"
    return "portable"


def levels_here() -> tuple[str, ...]:
    """The kernel levels this CPU can run (each a subset of the next one's instructions), lowest first; empty
    without the compiled library."""
    lib = _library()
    if lib is None:
        return ()
    mask = lib.quant_levels()
    return tuple(name for i, name in enumerate(LEVELS) if (mask >> i) & 1)


class QuantKernelError(RuntimeError):
    """A kernel level that is not compiled in or that this CPU cannot run, or a failed kernel call."""


LIBRARY = "_quant_ops"
# Kernel levels, by csrc/quant.h's numbers.
LEVELS = ("portable", "avx2", "avx2-vnni", "avx512-vnni")
# How the block types' kernels take x: quantized per block of 32 (the default), or as float32 (see the module
# docstring).
ACTIVATIONS = ("int8", "float32")
FLOAT_TYPES = frozenset((GGMLType.F32, GGMLType.F16, GGMLType.BF16))
_FAILURES = {1: "level not compiled in or not supported by this CPU", 2: "out of memory", 3: "bad type or shape"}
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURES = {
    "quant_levels": ([], _I),
    "quant_packed_bytes": ([_I, _L, _L], _L),  # type, rows, cols
    "quant_pack": ([_I, _P, _L, _L, _L, _P, _I], _I),  # type, src, row bytes, rows, cols, dst, threads
    "quant_linear": ([_I, _I, _P, _L, _L, _P, _L, _P, _L, _I], _I),  # level, type, packed, n, k, x, m, y, ldy, threads
    "quant_linear_f32": ([_I, _I, _P, _L, _L, _P, _L, _P, _L, _I], _I),  # the same
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.library(LIBRARY)
    if lib is None:
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def compiled() -> bool:
    """Whether the compiled kernels are installed (setup.py builds them with the others)."""
    return _library() is not None


def library() -> ctypes.CDLL | None:
    """The compiled kernels' library, its functions typed; None where it is not installed."""
    return _library()


def kernel_function(activations: str) -> Any:
    """The C function QuantLinear calls for `activations` (quant_linear or quant_linear_f32), for a caller in C
    (step_program.py). Raises QuantKernelError without the compiled library."""
    lib = _library()
    if lib is None:
        raise QuantKernelError(f"the compiled library {LIBRARY} is not installed")
    return lib.quant_linear if activations == "int8" else lib.quant_linear_f32


def _check_input(x: torch.Tensor, cols: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != cols or not x.is_cpu:
        raise ValueError(f"x must be CPU float32 [rows, {cols}], got {x.dtype} {list(x.shape)} on {x.device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")


# --- decoding: llama.cpp's dequantize_row_* over whole tensors of blocks ---------------------------------------


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [nblocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: the 16 low nibbles, then the 16 high ones (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[n, count // 8] bytes -> [n, count] of their bits, little-endian (bit j of the whole field at j)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], count)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit (scale, min) pairs -> two [n, 8] tensors (ggml's get_scale_min_k4)."""
    s = scales.to(torch.int32)
    low = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    high_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([low[0], high_sc], dim=1), torch.cat([low[1], high_m], dim=1)


def _decode(kind: GGMLType, data: torch.Tensor, cols: int) -> torch.Tensor:
    rows = data.shape[0]
    if kind == GGMLType.F32:
        return data.contiguous().view(torch.float32).reshape(rows, cols).clone()
    if kind in (GGMLType.F16, GGMLType.BF16):
        dtype = torch.float16 if kind == GGMLType.F16 else torch.bfloat16
        return data.contiguous().view(dtype).reshape(rows, cols).float()
    per_block, nbytes = _layout(kind)
    blocks = data.reshape(-1, nbytes)
    values = _DECODERS[kind](blocks)
    return values.reshape(rows, cols)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * (_nibbles(b[:, 2:18]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * _nibbles(b[:, 4:20]).float() + _half(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)
    return _half(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
    return _half(b, 0) * q.float() + _half(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, m = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)  # sub-block 2c: low nibbles, 2c + 1: high
    d = _half(b, 0)[:, :, None] * sc[:, :, None].float()
    dm = _half(b, 2)[:, :, None] * m[:, :, None].float()
    return (d * q.float() - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, m = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48]
    qs = b[:, 48:176].reshape(n, 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    high = (qh[:, None, :] >> torch.arange(8, dtype=torch.uint8)[None, :, None]) & 1  # sub-block j: bit j of qh
    q = low | (high << 4)
    d = _half(b, 0)[:, :, None] * sc[:, :, None].float()
    dm = _half(b, 2)[:, :, None] * m[:, :, None].float()
    return (d * q.float() - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _half(b, 208)
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [n, half, 2, 64]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3  # [n, half, 4, 32]
    q = (low.reshape(n, 2, 128) | (high.reshape(n, 2, 128) << 4)).reshape(n, 16, 16).float() - 32
    return (d[:, :, None] * scales[:, :, None] * q).reshape(n, QK_K)


_DECODERS = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
