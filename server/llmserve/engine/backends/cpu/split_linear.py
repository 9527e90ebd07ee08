"""Float32 linears on AMX tiles, each as three bfloat16 products (csrc/amx_ops.c): `--fp32-matmul bf16x3`.

x @ w.T with x and w each split into a bfloat16 head and tail, hi(x).hi(w) + hi(x).lo(w) + lo(x).hi(w), summed in
float32 by the tiles. The error is a few units in float32's 2^-17th of the largest output (~4e-6 measured, float32
GEMM's own ~6e-7), not bfloat16's 2^-9th: all-MiniLM-L6-v2's embeddings stay within 1e-5 of sentence-transformers'
float32 (tests/engine/test_split_linear.py). Three products cost three times one, but AMX-BF16 multiplies ~16x as fast
as float32's FMAs, so the linears of an encoder step take about half the time (all-MiniLM-L6-v2's four linears at
512 rows, 2 threads: 0.67 / 0.27 / 0.84 / 0.97 ms against oneDNN's packed float32 1.35 / 0.46 / 1.80 / 1.68 ms;
benchmarks/README.md has the whole encoder and the server).

Where it runs (`Fp32Matmul.resolve`): `--fp32-matmul auto` picks bf16x3 where the CPU has AMX-BF16 (capped by
LLMSERVE_CPU_ISA), the compiled library is installed and Linux grants this process the tile state; `ieee` keeps
float32's own GEMM everywhere. It applies to the linears of an encoder (BERT family) only: a decoder's float32 path
is the one the exactness tests against transformers' `generate` hold to (greedy tokens of near ties would move).

A row's result does not depend on the rows beside it (each output sums in one fixed order), so an input's vector is
the same alone or in any step.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging

import torch

from llmserve import cpu_features
from llmserve.engine.backends.cpu import native

log = logging.getLogger(__name__)

LIBRARY = "_amx_ops"
_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "amx_request": ([], _I),
    # x, m, k, packed w, n, np, kp, bias, residual, y, threads
    "amx_linear_split3": ([_P, _L, _L, _P, _L, _L, _L, _P, _P, _P, _I], _I),
}


class Fp32Matmul(enum.StrEnum):
    """How an encoder's float32 linears multiply (`--fp32-matmul`)."""

    AUTO = "auto"
    IEEE = "ieee"
    BF16X3 = "bf16x3"

    def resolve(self) -> Fp32Matmul:
        """IEEE or BF16X3: what `auto` gives on this machine; BF16X3 asked for where it cannot run is ValueError."""
        if self is Fp32Matmul.IEEE:
            return self
        missing = why_unavailable()
        if missing is None:
            return Fp32Matmul.BF16X3
        if self is Fp32Matmul.BF16X3:
            raise ValueError(f"--fp32-matmul bf16x3 cannot run here: {missing}")
        return Fp32Matmul.IEEE


def why_unavailable() -> str | None:
    """Why bf16x3 linears cannot run in this process, or None where they can."""
    level = cpu_features.cpu_level()
    if not cpu_features.at_least(level, "avx512_core_amx"):
        return f"it needs AMX-BF16 (this CPU's level, as capped: {level})"
    lib = _library()
    if lib is None:
        return f"the compiled library {LIBRARY} is not installed (`make kernels`)"
    if not _granted():
        return "Linux did not grant this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.library(LIBRARY)
    if lib is None or not hasattr(lib, "amx_linear_split3"):  # built on a CPU family without the kernel
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


@functools.cache
def _granted() -> bool:
    lib = _library()
    return lib is not None and lib.amx_request() == 0


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """`weight` [n, k] float32 as the kernel reads it: [hi | lo | hi] along k (3k, padded to kp, a multiple of 32),
    n padded to np (a multiple of 32), in tiles of 16 pairs of k by 16 columns. Returns (packed, np, kp)."""
    n, k = weight.shape
    hi = weight.to(torch.bfloat16)
    lo = (weight - hi.float()).to(torch.bfloat16)
    n_pad, k_pad = -(-n // 32) * 32, -(-3 * k // 32) * 32
    split = torch.zeros(n_pad, k_pad, dtype=torch.bfloat16)
    split[:n, : 3 * k] = torch.cat([hi, lo, hi], dim=1)
    tiles = split.view(n_pad // 16, 16, k_pad // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    return tiles, n_pad, k_pad


class SplitLinear:
    """x @ weight.T + bias (+ residual) in three bfloat16 products on AMX tiles; x float32 [rows, in] on the CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        lib = _library()
        if lib is None or weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_cpu:
            raise ValueError("a split linear needs the compiled library and a float32 CPU weight [out, in]")
        self._lib = lib
        self.out_features, self.in_features = weight.shape
        self._packed, self._n_pad, self._k_pad = pack(weight.detach())
        self._bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features or not x.is_cpu:
            raise ValueError(f"x must be CPU float32 [rows, {self.in_features}], got {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features)
        if residual is not None:
            if residual.shape != out.shape or residual.dtype != torch.float32:
                got = f"{residual.dtype} {list(residual.shape)}"
                raise ValueError(f"residual must be float32 {list(out.shape)}, got {got}")
            residual = residual.contiguous()
        if rows == 0:
            return out
        failed = self._lib.amx_linear_split3(
            x.data_ptr(), rows, self.in_features, self._packed.data_ptr(), self.out_features, self._n_pad,
            self._k_pad, _address(self._bias), _address(residual), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("the split linear's scratch could not be allocated")
        return out


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
