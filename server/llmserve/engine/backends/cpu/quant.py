"""GGUF tensors kept as the file holds them (llama.cpp's block types), and linears computed from their blocks.

The seam between the GGUF loader and the kernels: a `QuantWeight` is one 2-D tensor's bytes as the file stores
them (llama.cpp's ggml-common.h layouts), `dequantize` is the float32 reference, `QuantLinear` computes x @ W.T.

This first version computes every linear by dequantizing the blocks on each call and multiplying one row at a
time (a row's result is the same whatever the other rows of the call: batch invariance); the compiled kernels
come behind the same API.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class GGMLType(enum.IntEnum):
    """GGUF's numeric tensor type ids (ggml's `enum ggml_type`), of the types this module knows."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


SUPPORTED: frozenset[GGMLType] = frozenset(GGMLType)

QK_K = 256
# (weights per block, bytes per block), as ggml's type traits give them.
_BLOCK: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}


class QuantFormatError(ValueError):
    """A tensor's type or bytes do not make a valid QuantWeight; the message names what is wrong."""


def block_size(kind: GGMLType) -> int:
    """Weights per block of `kind` (1 for the float types)."""
    return _BLOCK[_kind(kind)][0]


def row_bytes(kind: GGMLType, cols: int) -> int:
    """Bytes of one row of `cols` weights in `kind`. Raises QuantFormatError when `cols` is not a whole number of
    blocks."""
    per_block, nbytes = _BLOCK[_kind(kind)]
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
    A row's result is bitwise the same whatever the other rows of the call and whatever M (batch invariance)."""

    __slots__ = ("weight", "out_features", "in_features", "nbytes")

    def __init__(self, w: QuantWeight) -> None:
        self.weight = w
        self.out_features = w.rows
        self.in_features = w.cols
        self.nbytes = w.data.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.in_features)
        w = dequantize(self.weight)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for i in range(x.shape[0]):  # one row at a time: the same kernel for a row whatever M
            out[i] = F.linear(x[i : i + 1], w)[0]
        return out


def kernel_level() -> str:
    """Which kernel variant computes QuantLinear here: "torch" in this version (dequantize, then torch's matmul)."""
    return "torch"


def _check_input(x: torch.Tensor, cols: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != cols or x.device.type != "cpu":
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
    per_block, nbytes = _BLOCK[kind]
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
