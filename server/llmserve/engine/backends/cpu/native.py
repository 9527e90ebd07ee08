"""The CPU backend's compiled kernels (csrc/), built at install time by setup.py and loaded with ctypes.

- `PagedDecode` (csrc/paged_decode.c, library `_paged_decode`): decode attention over the paged cache, one
  function per common (head_dim, query heads per kv head) pair, which the source takes as constants so that
  its inner loops vectorize fully.
- `FusedOps` (csrc/fused_ops.c, library `_fused_ops`): the elementwise parts of a Llama-family layer (RMSNorm,
  residual add plus RMSNorm, rotary embedding, SiLU-and-multiply), used by fused_layers.py.

A start never compiles anything. Where a library is missing (no compiler at install time), `usable` decides by
the `--cpu-kernels` policy: `auto` runs the torch paths, which compute the same things, after one warning;
`require` refuses to start; `off` never loads them.
"""

from __future__ import annotations

import ctypes
import logging
import sysconfig
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LIBRARY_DIR = Path(__file__).parent
LIBRARIES = ("_paged_decode", "_fused_ops")
POLICIES = ("auto", "require", "off")
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.float64: "paged_decode_f64"}

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}
_warned = False


class KernelsMissing(RuntimeError):
    """`--cpu-kernels require`, and the compiled kernels are not installed."""


def library(name: str) -> ctypes.CDLL | None:
    """The installed library `name` (one of LIBRARIES), loaded once; None where it is not installed."""
    with _lock:
        if name not in _libraries:
            path = LIBRARY_DIR / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
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

    dtypes = frozenset(_FUNCTIONS)

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
