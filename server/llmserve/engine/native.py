"""The CPU decode-attention kernel (csrc/paged_decode.c), compiled once per process with the system's C compiler.

Compiling takes about half a second and needs no torch headers. It is built once per process and per
(head_dim, query heads per kv head), which the source takes as constants so that its inner loops vectorize
fully; the library goes to a private temporary folder, so no stale build outlives a change of source,
compiler or CPU. Where there is no compiler, or the build fails, `load()` returns None (logged) and the
runner uses its torch path, which computes the same attention by gathering the context first.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# Tried in order: with glibc's vector exp (x86-64 glibc >= 2.22), then without.
VARIANTS = (("-DVECTOR_EXP", "-lmvec"), ())
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.float64: "paged_decode_f64"}

_lock = threading.Lock()
_loaded: dict[tuple[int, int], PagedDecode | None] = {}


class PagedDecode:
    """ctypes binding of the kernel; `__call__` checks layouts, then runs it on the CPU."""

    dtypes = frozenset(_FUNCTIONS)

    def __init__(self, library: ctypes.CDLL, head_dim: int, group: int) -> None:
        self.head_dim, self.group = head_dim, group
        self._fns = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(library, name)
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


def load(head_dim: int, group: int) -> PagedDecode | None:
    """The kernel for this head size and GQA group, built on first use in this process; None where it
    cannot be built."""
    key = (head_dim, group)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _build(head_dim, group)
        return _loaded[key]


def _build(head_dim: int, group: int) -> PagedDecode | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention uses the slower torch path")
        return None
    folder = tempfile.mkdtemp(prefix="llmserve-native-")
    try:
        detail: object = None
        for variant in VARIANTS:
            target = os.path.join(folder, f"paged_decode{len(variant)}.so")
            command = [compiler, *FLAGS, f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", "-o", target, str(SOURCE)]
            try:
                subprocess.run([*command, *variant, "-lm"], check=True, capture_output=True, text=True, timeout=120)
                return PagedDecode(ctypes.CDLL(target), head_dim, group)
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
        log.warning("building %s failed (%s): CPU decode attention uses the slower torch path", SOURCE.name, detail)
        return None
    finally:
        # A loaded library stays mapped after its file is gone.
        shutil.rmtree(folder, ignore_errors=True)
