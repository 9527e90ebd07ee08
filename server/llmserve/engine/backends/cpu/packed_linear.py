"""CPU linear layers on weights prepared once at load for oneDNN (through torch's mkldnn and onednn ops).

- float32: each weight reordered once into oneDNN's blocked layout. ATen's default float32 GEMM on the CPU
  repacks the weight on every call, which costs most at the small row counts of decode steps. Measured on the
  2-core benchmark machine (SmolLM2-135M's seven projections of one layer, median of 7; /tmp benchmark, see issue
  5's note): 32 rows 4.07 -> 3.29 ms, 160 rows 12.3 -> 10.0 ms, 512 rows 36.8 -> 31.3 ms. The price is a second
  copy of every packed weight.
- bfloat16 (`PackedBF16`): bfloat16 weights in oneDNN's blocked layout, bfloat16 rows in, float32 accumulation,
  bfloat16 rows out (oneDNN's brgemm: AMX tiles where the CPU has them, AVX512-BF16 dot products below).
- int8 (`Int8Linear`): weights int8 with one scale per output channel; each input row quantized to int8 with its
  own scale (native.QuantizedRows, made by the fused row operations), the products summed in int32 by oneDNN's
  u8 x s8 kernels (AMX-INT8 or AVX512-VNNI), then scaled back per channel and per row.

Batch invariance: a row's result must not depend on the other rows of the call, or a request's greedy tokens
would change with the traffic beside it. int8 sums integers, exactly, in any order. oneDNN's bfloat16 kernels
change how they block the reduction with the row count once it is longer than 1,024 (measured here: SmolLM2's
down projection, K = 1,536, gave other results at 145 of 150 row counts from 1 to 1,024 than at one row; every K
up to 1,024 gave the same at all). `PackedBF16` splits longer reductions into equal parts of at most
`MAX_BF16_REDUCTION`, the first part's result added by the next call's fused add (oneDNN's binary post-op):
invariant at every row count tested, the price one more rounding to bfloat16 per part (mean absolute error of the
down projection 0.0022 -> 0.0028, time +17% at 512 rows, +25 us a call at one). Those figures are from an
AVX512-BF16 machine. On AMX the kernel also blocks the rows by the row count: the CI machine's Xeon gave some
rows other results than alone from 35 rows up (K = 576 and 1,536 both), every count up to 34 the same; so there
`PackedBF16` runs at most a block of rows a call (`rows`), a longer call in blocks of that many. The block is
checked once per process (`bf16_row_block`): the largest of AMX_ROW_BLOCKS at which every row count up to it gives
each row what it gives alone, on both reduction widths, so that another CPU or oneDNN build that blocks otherwise
falls back to smaller calls instead of serving results that depend on the batch.

`pack_linears` swaps the forward of each float32 `nn.Linear` for one that calls the packed weight (the path of
models the fused forward does not serve); the modules and their parameters stay as they are.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmserve import cpu_features
from llmserve.engine.backends.cpu.native import MixedOps, QuantizedRows, Rows

_PACKED = "_llmserve_packed_weight"
MAX_BF16_REDUCTION = 1024
BATCH_HINT = 64  # the row count oneDNN's layouts are tuned for; any row count works
KINDS = ("float32", "bfloat16", "int8")
# The most rows a bfloat16 call runs on AMX, largest first: every row count up to 34 gave each row what it gives
# alone on the CI's Xeon (see the module docstring), 32 a whole AMX tile's 16 rows twice.
AMX_ROW_BLOCKS = (32, 16, 8, 4, 2, 1)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build can run packed float32 linears for this device and dtype."""
    ops = torch.ops.mkldnn
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def bf16_available() -> bool:
    """Whether oneDNN runs bfloat16 linears on this CPU, as capped (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # type: ignore[no-untyped-call]


def pack_weight(weight: torch.Tensor, batch_hint: int = BATCH_HINT) -> torch.Tensor:
    """`weight` [out, in] (float32 or bfloat16) in oneDNN's blocked layout, tuned for `batch_hint` rows."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with a weight from `pack_weight`; x rows contiguous, of the weight's dtype."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class Linear(Protocol):
    """One of the fused forward's linears: reads rows of `takes` (uint8: native.QuantizedRows), gives `gives`."""

    takes: torch.dtype
    gives: torch.dtype

    @property
    def packed(self) -> bool:
        """Whether the weights are in oneDNN's blocked layout (a dense weight computes the same, only slower)."""
        ...

    def __call__(self, x: Rows) -> torch.Tensor: ...


@dataclass(slots=True)
class PlainLinear:
    """F.linear on the weight as it is (float64, or float32 with packing off)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    takes: torch.dtype
    gives: torch.dtype
    packed: bool = False

    def __call__(self, x: Rows) -> torch.Tensor:
        assert isinstance(x, torch.Tensor)
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class PackedF32:
    """A float32 weight packed once."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    takes: torch.dtype = torch.float32
    gives: torch.dtype = torch.float32

    @property
    def packed(self) -> bool:
        return self.weight.is_mkldnn

    def __call__(self, x: Rows) -> torch.Tensor:
        assert isinstance(x, torch.Tensor)
        return linear(x, self.weight, self.bias)


def bf16_row_block(level: str | None = None) -> int | None:
    """The most rows a batch-invariant bfloat16 call may run on a CPU of `level` (this one's, as capped, by
    default): with AMX, the largest of AMX_ROW_BLOCKS that this process's kernels keep invariant; else no limit."""
    level = cpu_features.cpu_level() if level is None else level
    return _invariant_block() if cpu_features.at_least(level, "avx512_core_amx") else None


@functools.cache
def _invariant_block() -> int:
    """largest_invariant_block for SmolLM2's reduction widths (576; 1,536, in two parts), measured once."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for k in (576, 1536):
        weight, bias = torch.randn(96, k, generator=g) * 0.05, torch.randn(96, generator=g)
        layers.append((PackedBF16.of(weight, bias), torch.randn(2 * AMX_ROW_BLOCKS[0], k, generator=g).bfloat16()))
    return largest_invariant_block(layers)


def largest_invariant_block(layers: list[tuple[PackedBF16, torch.Tensor]]) -> int:
    """The largest of AMX_ROW_BLOCKS at which, for each (linear, rows) of `layers` (more rows than the largest
    block), every row count up to it gives each row bit for bit what it gives alone, each count at three offsets
    into the rows (the kernel's result may depend on where the rows start)."""
    alone = [torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])]) for linear, x in layers]

    def alike(linear: PackedBF16, x: torch.Tensor, one: torch.Tensor, m: int) -> bool:
        room = x.shape[0] + 1 - m
        starts = {0, (m * 37) % room, (m * 11 + 5) % room}
        return all(torch.equal(linear(x[s : s + m]), one[s : s + m]) for s in starts)

    for block in AMX_ROW_BLOCKS[:-1]:
        if all(alike(*layer, one, m) for layer, one in zip(layers, alone, strict=True) for m in range(1, block + 1)):
            return block
    return 1


@dataclass(slots=True)
class PackedBF16:
    """A bfloat16 weight packed once, its reduction in parts of at most MAX_BF16_REDUCTION (see the module
    docstring): `parts` [(start, packed weight of columns [start, start + width))]; `rows`: the most rows a call
    runs (None: any), longer inputs in blocks of that many."""

    parts: list[tuple[int, torch.Tensor]]
    width: int
    bias: torch.Tensor | None  # float32
    rows: int | None = None
    takes: torch.dtype = torch.bfloat16
    gives: torch.dtype = torch.bfloat16

    @property
    def packed(self) -> bool:
        return all(part.is_mkldnn for _, part in self.parts)

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, rows: int | None = None) -> PackedBF16:
        k = weight.shape[1]
        count = -(-k // MAX_BF16_REDUCTION)
        width = -(-k // count)
        w = weight.to(torch.bfloat16)
        parts = [(s, pack_weight(w[:, s : s + width].contiguous())) for s in range(0, k, width)]
        return cls(parts, width, None if bias is None else bias.float(), rows)

    def __call__(self, x: Rows) -> torch.Tensor:
        assert isinstance(x, torch.Tensor)
        rows = self.rows
        if rows is None or x.shape[0] <= rows:
            return self._call(x)
        return torch.cat([self._call(x[i : i + rows]) for i in range(0, x.shape[0], rows)])

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        start, first = self.parts[0]
        out = linear(x[:, start : start + self.width], first, self.bias)
        for start, part in self.parts[1:]:  # x's columns as strided views: no copy
            out = torch.ops.mkldnn._linear_pointwise.binary(x[:, start : start + self.width], out, part, None, "add")
        return out


@dataclass(slots=True)
class Int8Linear:
    """An int8 weight with a float32 scale per output channel, packed once for oneDNN's u8 x s8 kernels; the
    input rows quantized per row (QuantizedRows). The int32 sums come back scaled by the channel's scale (oneDNN)
    and are finished by `ops.convert` (the row's scale, then the bias) into `gives`."""

    weight: torch.Tensor  # oneDNN's packed int8
    scales: torch.Tensor  # float32 [out]
    zero_points: torch.Tensor  # int64 zeros [out]: symmetric
    bias: torch.Tensor | None  # float32
    ops: MixedOps
    gives: torch.dtype
    takes: torch.dtype = torch.uint8

    @property
    def packed(self) -> bool:
        return self.weight.is_mkldnn

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, ops: MixedOps, gives: torch.dtype) -> Int8Linear:
        w = weight.float()
        top = w.abs().amax(dim=1)
        scales = torch.where(top > 0, top / 127, torch.ones_like(top))
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        packed = torch.ops.onednn.qlinear_prepack(q, [BATCH_HINT, w.shape[1]])
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        return cls(packed, scales.contiguous(), zeros, None if bias is None else bias.float(), ops, gives)

    def __call__(self, x: Rows) -> torch.Tensor:
        assert isinstance(x, QuantizedRows)
        acc: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
            x.values, 1.0, 128, self.weight, self.scales, self.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )
        out = self.ops.convert(acc, self.gives, x.scales, self.bias)
        assert isinstance(out, torch.Tensor)
        return out


@dataclass(slots=True)
class RefinedHead:
    """An LM head whose logits come from a bfloat16 or int8 linear, its `candidates` highest per row then
    recomputed in float32 from the model's own weight rows: the greedy pick and the top logprobs as a float32
    head gives them, at the cost of the cheaper head. Bare bfloat16 logits are rounded to a step of 1/8 at 16-32,
    where the best two tokens of a greedy step are often closer than that; measured on SmolLM2-135M (16 prompts,
    64 greedy tokens, benchmarks/probes/dtype_accuracy.py): 4 of 16 prompts identical to float32 with the bfloat16
    head, 10 with a float32 one, which costs +1.5 ms a decode step at one row (2.9 vs 1.4 ms) and +2.9 ms at 32."""

    head: Linear
    weight: torch.Tensor  # [vocab, hidden], the model's own rows (bfloat16)
    ops: MixedOps
    candidates: int = 8
    takes: torch.dtype = torch.float32
    gives: torch.dtype = torch.float32

    @property
    def packed(self) -> bool:
        return self.head.packed

    def __call__(self, x: Rows) -> torch.Tensor:
        assert isinstance(x, torch.Tensor)
        logits = self.head(self.ops.convert(x, self.head.takes)).float()
        top = logits.topk(self.candidates, dim=-1).indices
        # Each row's candidates: a product and a sum per (row, candidate), computed alike for any row count.
        exact = (self.weight[top].float() * x[:, None, :]).sum(-1)
        return logits.scatter_(1, top, exact)


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, kind: str, pack: bool, ops: MixedOps | None, gives: torch.dtype
) -> Linear:
    """The fused forward's linear over `weight` [out, in] for a `kind` of KINDS (float64 models: plain).
    `pack`: float32 packed for oneDNN (else plain); `gives`: int8's output dtype (float32 or bfloat16)."""
    if kind == "bfloat16":
        return PackedBF16.of(weight, bias, bf16_row_block())
    if kind == "int8":
        if ops is None:
            raise ValueError("int8 linears need the compiled row operations")
        return Int8Linear.of(weight, bias, ops, gives)
    if pack and weight.dtype == torch.float32:
        return PackedF32(pack_weight(weight), bias)
    return PlainLinear(weight, bias, weight.dtype, weight.dtype)


def sample_input(linear: Linear, in_features: int, rows: int = 4) -> Rows:
    """Zeros in the format `linear` reads, [rows, in_features]."""
    if linear.takes == torch.uint8:
        return QuantizedRows(torch.full((rows, in_features), 128, dtype=torch.uint8), torch.ones(rows))
    return torch.zeros(rows, in_features, dtype=linear.takes)


def onednn_implementation(call: Callable[[], object]) -> str | None:
    """The oneDNN implementation `call` runs, as oneDNN's verbose mode names it (e.g. `brg_matmul:avx512_core_bf16`,
    with the instruction set it dispatched to), or None where oneDNN ran nothing. The verbose lines go to the
    process's standard output (C stdio), which is captured for the one call; run it before serving."""
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as capture:
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(capture.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):  # type: ignore[no-untyped-call]
                call()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        text = capture.read().decode(errors="replace")
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 6 and fields[2:5] == ["primitive", "exec", "cpu"] and fields[5] in ("matmul", "inner_product"):
            return fields[6]
    return None


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x.contiguous(), getattr(self, _PACKED), self.bias)


@torch.inference_mode()
def pack_linears(model: nn.Module, batch_hint: int = BATCH_HINT) -> int:
    """Route every float32 `nn.Linear` of `model` through a packed copy of its weight; returns how many.

    Idempotent: layers packed before are left alone. `batch_hint` is the row count the layout is tuned for;
    any row count works.
    """
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or hasattr(module, _PACKED) or module.weight.dtype != torch.float32:
            continue
        setattr(module, _PACKED, pack_weight(module.weight.detach(), batch_hint))
        setattr(module, "forward", types.MethodType(_packed_forward, module))  # noqa: B010 - a method, typed
        count += 1
    return count
