"""The CPU backend's compiled kernels (csrc/), built at install time by setup.py and loaded with ctypes.

- `PagedDecode` (csrc/paged_decode.c, library `_paged_decode`): decode attention over the paged cache, one
  function per common (head_dim, query heads per kv head) pair, which the source takes as constants so that
  its inner loops vectorize fully.
- `FusedOps` (csrc/fused_ops.c, library `_fused_ops`): the elementwise parts of a Llama-family layer (RMSNorm,
  residual add plus RMSNorm, rotary embedding, SiLU-and-multiply), used by fused_layers.py.
- `MixedOps` (csrc/mixed_ops.c, the same library): those operations over bfloat16 and int8-quantized rows, for
  the bfloat16 and int8 linears (QuantizedRows).

On x86-64 `_paged_decode` and `_fused_ops` come in two builds (setup.py): for AVX2 and up, and `_portable` for the
x86-64 baseline, which a CPU below AVX2 (or a server capped to `LLMSERVE_CPU_ISA=none`) loads instead.

A start never compiles anything. Where a library is missing (no compiler at install time), `usable` decides by
the `--cpu-kernels` policy: `auto` runs the torch paths, which compute the same things, after one warning;
`require` refuses to start; `off` never loads them.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmserve import cpu_features

log = logging.getLogger(__name__)

LIBRARY_DIR = Path(__file__).parent
LIBRARIES = ("_paged_decode", "_fused_ops")
# Built per level on x86-64 (setup.py's PORTABLE suffix for the baseline build).
PER_LEVEL = frozenset(LIBRARIES)
PORTABLE = "_portable"
X86 = platform.machine().lower() in ("x86_64", "amd64")
POLICIES = ("auto", "require", "off")
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.float64: "paged_decode_f64", torch.bfloat16: "paged_decode_bf16"}

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}
_warned = False


class KernelsMissing(RuntimeError):
    """`--cpu-kernels require`, and the compiled kernels are not installed."""


def library_file(name: str, level: str | None = None) -> Path:
    """Where the installed library `name` lies: for LIBRARIES on x86-64, the build of the CPU's `level` (this one's,
    as LLMSERVE_CPU_ISA caps it, by default): the baseline build below AVX2, the AVX2 build from AVX2 up."""
    if name in PER_LEVEL and X86 and (cpu_features.cpu_level() if level is None else level) == "none":
        name += PORTABLE
    return LIBRARY_DIR / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"


def library(name: str) -> ctypes.CDLL | None:
    """The installed library `name` (of LIBRARIES, or quant's and split_linear's) for this CPU's level, loaded once;
    None where it is not installed."""
    with _lock:
        if name not in _libraries:
            path = library_file(name)
            try:
                _libraries[name] = ctypes.CDLL(str(path))
            except OSError as exc:
                log.debug("CPU kernel library %s not loaded: %s", path, exc)
                _libraries[name] = None
        return _libraries[name]


def usable(policy: str) -> bool:
    """Whether the CPU backend runs the compiled kernels, by `policy` (see the module docstring)."""
    global _warned
    if policy not in POLICIES:
        raise ValueError(f"--cpu-kernels must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "off":
        return False
    missing = [name for name in LIBRARIES if library(name) is None]
    if not missing:
        return True
    where = f"{', '.join(missing)} not installed in {LIBRARY_DIR}; `make kernels` or reinstall with a C compiler"
    if policy == "require":
        raise KernelsMissing(f"--cpu-kernels require: {where}")
    if not _warned:
        log.warning("CPU kernels unavailable (%s): serving with the slower torch paths", where)
        _warned = True
    return False


class PagedDecode:
    """ctypes binding of the kernel; `__call__` checks layouts, then runs it on the CPU."""

    dtypes = frozenset(_FUNCTIONS)

    def __init__(self, library: ctypes.CDLL, head_dim: int, group: int) -> None:
        """Raises AttributeError where the library has no function for this (head_dim, group)."""
        self.head_dim, self.group = head_dim, group
        self._fns = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(library, f"{name}_d{head_dim}_g{group}")
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p, ctypes.c_long, ctypes.c_long,  # q, seq stride, head stride
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,  # k, v, kv-head stride
                ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,  # tables, table stride, lens
                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # seqs, kv heads, block size, max len
                ctypes.c_double, ctypes.c_void_p, ctypes.c_int,  # scale, out, threads
            ]  # fmt: skip
            self._fns[dtype] = fn

    def function(self, dtype: torch.dtype) -> Any:
        """The C function for `dtype` rows, for a caller in C (step_program.py)."""
        return self._fns[dtype]

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        max_len: int,
        block_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """query [seqs, heads, dim] (dim contiguous); k/v_cache [kv_heads, slots, dim] contiguous;
        tables [seqs, width] and lens [seqs] int32 contiguous, max_len >= every length;
        out [seqs, heads, dim] contiguous, written."""
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[0]
        if head_dim != self.head_dim or num_heads != num_kv_heads * self.group:
            raise ValueError(f"kernel built for head_dim {self.head_dim}, group {self.group}; got {tuple(query.shape)}")
        if query.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("paged_decode needs a dim-contiguous query and contiguous cache and output")
        if tables.dtype != torch.int32 or lens.dtype != torch.int32 or not tables.is_contiguous():
            raise ValueError("paged_decode needs contiguous int32 block tables and lengths")
        failed = self._fns[query.dtype](
            query.data_ptr(), query.stride(0), query.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            num_seqs, num_kv_heads, block_size, max_len,
            scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("paged_decode could not allocate its score buffer")


_P, _L, _I, _D = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double
_FUSED_SIGNATURES = {
    "rms_norm": [_P, _L, _P, _P, _L, _L, _I, _D, _I],  # x, x row stride, w, out, out row stride, rows, dim, eps
    "add_rms_norm": [_P, _P, _L, _P, _P, _L, _I, _D, _I],  # residual, x, x row stride, w, out, rows, dim, eps
    "rotary": [_P, _L, _L, _I, _L, _P, _P, _L, _I, _I],  # x, tok/head strides, heads, tokens, cos, sin, cs stride, dim
    "silu_mul": [_P, _P, _L, _I, _I],  # gate_up, out, rows, inter
}  # each ends with the thread count


class FusedOps:
    """ctypes binding of csrc/fused_ops.c. Tensors are CPU float32 or float64, rows dim-contiguous; each
    method checks what the C side relies on."""

    dtypes = frozenset((torch.float32, torch.float64))

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {}
        for name, argtypes in _FUSED_SIGNATURES.items():
            for dtype, suffix in ((torch.float32, "_f32"), (torch.float64, "_f64")):
                fn = getattr(library, name + suffix)
                fn.restype, fn.argtypes = None, argtypes
                self._fns[name, dtype] = fn

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """w * x / sqrt(mean(x^2) + eps) over the last dim of x [rows, dim]; a new contiguous tensor."""
        rows, dim = x.shape
        _check_rows(x, weight)
        out = torch.empty(rows, dim, dtype=x.dtype)
        self._fns["rms_norm", x.dtype](
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), dim, rows, dim, eps, torch.get_num_threads()
        )
        return out

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place (residual contiguous [rows, dim]), then rms_norm(residual) as a new tensor."""
        rows, dim = residual.shape
        _check_rows(x, weight)
        if not residual.is_contiguous() or x.shape != residual.shape or residual.dtype != x.dtype:
            raise ValueError("add_rms_norm needs a contiguous residual of the shape and dtype of x")
        out = torch.empty(rows, dim, dtype=x.dtype)
        self._fns["add_rms_norm", x.dtype](
            residual.data_ptr(), x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, dim, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [tokens, heads, dim] in place by cos/sin [tokens, dim] (contiguous), rotate-half form."""
        tokens, heads, dim = x.shape
        if x.stride(2) != 1 or dim % 2 or cos.shape != (tokens, dim) or sin.shape != cos.shape:
            raise ValueError(f"rotary: x {tuple(x.shape)} needs cos/sin [{tokens}, {dim}] and an even, contiguous dim")
        if not (cos.is_contiguous() and sin.is_contiguous()) or not x.dtype == cos.dtype == sin.dtype:
            raise ValueError("rotary needs contiguous cos/sin of x's dtype")
        self._fns["rotary", x.dtype](
            x.data_ptr(), x.stride(0), x.stride(1), heads, tokens, cos.data_ptr(), sin.data_ptr(), dim, dim,
            torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate_up[:, :I]) * gate_up[:, I:] for a contiguous gate_up [rows, 2I]; a new tensor."""
        rows, width = gate_up.shape
        if not gate_up.is_contiguous() or width % 2 or gate_up.dtype not in self.dtypes:
            raise ValueError("silu_mul needs a contiguous [rows, 2 * inter] tensor of float32 or float64")
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._fns["silu_mul", gate_up.dtype](
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out


@dataclass(slots=True)
class QuantizedRows:
    """Rows quantized to int8 for oneDNN's u8 x s8 kernels: row r holds (values[r] - 128) * scales[r]."""

    values: torch.Tensor  # uint8 [rows, n], contiguous
    scales: torch.Tensor  # float32 [rows]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


# Row formats of csrc/mixed_ops.c, by the dtype that names them here (uint8: QuantizedRows).
_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}
Rows = torch.Tensor | QuantizedRows
_MIXED_SIGNATURES = {
    "mixed_rms_norm": [_P, _I, _L, _P, _P, _I, _L, _P, _L, _I, _D, _I],  # x, fmt, stride, w, out, fmt, stride, scales..
    "mixed_add_rms_norm": [_P, _P, _I, _L, _P, _P, _I, _P, _L, _I, _D, _I],  # residual, x, fmt, stride, w, out, fmt..
    "mixed_rotary_bf16": [_P, _L, _L, _I, _L, _P, _P, _L, _I, _I],  # as rotary
    "mixed_silu_mul": [_P, _I, _P, _I, _P, _L, _I, _I],  # gate_up, fmt, out, fmt, scales, rows, inter
    "mixed_convert_rows": [_P, _I, _L, _P, _P, _P, _I, _P, _L, _I, _I],  # x, fmt, stride, row scale, bias, out..
}  # each ends with the thread count


class MixedOps:
    """ctypes binding of csrc/mixed_ops.c: the fused layer operations over float32 and bfloat16 rows, each
    writing its result in the format the next linear reads (`out`: float32, bfloat16, or uint8 for
    QuantizedRows), with float32 arithmetic and a float32 residual stream."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {}
        for name, argtypes in _MIXED_SIGNATURES.items():
            fn = getattr(library, name)
            fn.restype = ctypes.c_int if name != "mixed_rotary_bf16" else None
            fn.argtypes = argtypes
            self._fns[name] = fn

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype) -> Rows:
        """w * x / sqrt(mean(x^2) + eps) over x [rows, dim] (float32 or bfloat16, dim-contiguous), as `out`."""
        rows, dim = x.shape
        _check_mixed(x, weight)
        result, values, scales = _output(rows, dim, out)
        _ok(self._fns["mixed_rms_norm"](
            x.data_ptr(), _FORMATS[x.dtype], x.stride(0), weight.data_ptr(), values.data_ptr(), _FORMATS[out], dim,
            _ptr(scales), rows, dim, eps, torch.get_num_threads(),
        ))  # fmt: skip
        return result

    def add_rms_norm(
        self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype
    ) -> Rows:
        """residual (float32, contiguous) += x in place, then rms_norm(residual) as `out`."""
        rows, dim = residual.shape
        _check_mixed(x, weight)
        if residual.dtype != torch.float32 or not residual.is_contiguous() or x.shape != residual.shape:
            raise ValueError("add_rms_norm needs a contiguous float32 residual of the shape of x")
        result, values, scales = _output(rows, dim, out)
        _ok(self._fns["mixed_add_rms_norm"](
            residual.data_ptr(), x.data_ptr(), _FORMATS[x.dtype], x.stride(0), weight.data_ptr(), values.data_ptr(),
            _FORMATS[out], _ptr(scales), rows, dim, eps, torch.get_num_threads(),
        ))  # fmt: skip
        return result

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate bfloat16 x [tokens, heads, dim] in place by float32 cos/sin [tokens, dim] (contiguous)."""
        tokens, heads, dim = x.shape
        if x.dtype != torch.bfloat16 or x.stride(2) != 1 or dim % 2 or cos.shape != (tokens, dim):
            raise ValueError(
                f"rotary: bfloat16 x {tuple(x.shape)} with a contiguous even dim, cos/sin [{tokens}, {dim}]"
            )
        if cos.dtype != torch.float32 or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rotary needs contiguous float32 cos/sin")
        self._fns["mixed_rotary_bf16"](
            x.data_ptr(), x.stride(0), x.stride(1), heads, tokens, cos.data_ptr(), sin.data_ptr(), dim, dim,
            torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor, out: torch.dtype) -> Rows:
        """silu(gate_up[:, :I]) * gate_up[:, I:] for a contiguous float32/bfloat16 gate_up [rows, 2I], as `out`."""
        rows, width = gate_up.shape
        if not gate_up.is_contiguous() or width % 2 or gate_up.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("silu_mul needs a contiguous [rows, 2 * inter] tensor of float32 or bfloat16")
        result, values, scales = _output(rows, width // 2, out)
        _ok(self._fns["mixed_silu_mul"](
            gate_up.data_ptr(), _FORMATS[gate_up.dtype], values.data_ptr(), _FORMATS[out], _ptr(scales), rows,
            width // 2, torch.get_num_threads(),
        ))  # fmt: skip
        return result

    def convert(
        self,
        x: torch.Tensor,
        out: torch.dtype,
        row_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> Rows:
        """x [rows, n] (float32/bfloat16, n contiguous) times `row_scale` [rows] plus `bias` [n] (float32 each;
        None: 1 and 0), as `out`."""
        rows, n = x.shape
        if x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("convert needs float32 or bfloat16 rows with a contiguous last dim")
        if row_scale is not None and (row_scale.dtype != torch.float32 or row_scale.shape != (rows,)):
            raise ValueError(f"row_scale must be float32 [{rows}]")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous float32 [{n}]")
        result, values, scales = _output(rows, n, out)
        _ok(self._fns["mixed_convert_rows"](
            x.data_ptr(), _FORMATS[x.dtype], x.stride(0), _ptr(row_scale), _ptr(bias), values.data_ptr(),
            _FORMATS[out], _ptr(scales), rows, n, torch.get_num_threads(),
        ))  # fmt: skip
        return result


def _output(rows: int, n: int, fmt: torch.dtype) -> tuple[Rows, torch.Tensor, torch.Tensor | None]:
    if fmt not in _FORMATS:
        raise ValueError(f"no row format {fmt}")
    values = torch.empty(rows, n, dtype=fmt)
    if fmt != torch.uint8:
        return values, values, None
    scales = torch.empty(rows, dtype=torch.float32)
    return QuantizedRows(values, scales), values, scales


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ok(failed: int) -> None:
    if failed:
        raise MemoryError("a fused row operation could not allocate its scratch row")


def _check_mixed(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("mixed ops need CPU float32/bfloat16 rows [rows, dim] with a contiguous dim")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous() or weight.dtype != torch.float32:
        raise ValueError(f"weight must be contiguous float32 [{x.shape[1]}]")


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu" or x.dtype not in FusedOps.dtypes:
        raise ValueError("fused ops need CPU float32/float64 rows [rows, dim] with a contiguous dim")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"weight must be contiguous [{x.shape[1]}] of the rows' dtype")


def load(head_dim: int, group: int) -> PagedDecode | None:
    """The decode kernel for this head size and GQA group; None where the library or the pair is missing."""
    lib = library("_paged_decode")
    if lib is None:
        return None
    try:
        return PagedDecode(lib, head_dim, group)
    except AttributeError:
        log.info("no compiled decode kernel for head_dim %d, group %d: decode attention runs in torch", head_dim, group)
        return None


def load_fused() -> FusedOps | None:
    """The fused layer operations; None where the library is missing."""
    lib = library("_fused_ops")
    return None if lib is None else FusedOps(lib)


def load_mixed() -> MixedOps | None:
    """The fused layer operations over bfloat16 and int8 rows; None where the library is missing."""
    lib = library("_fused_ops")
    return None if lib is None else MixedOps(lib)
