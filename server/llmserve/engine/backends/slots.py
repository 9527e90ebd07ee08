"""Where a token's K/V lives in the paged cache: the one slot formula, slot = block * block_size + offset.

Position p of a sequence with block table `table` is at `table[p // block_size] * block_size + p % block_size`.
Every host-side computation of a slot goes through here (the KV cache's block ranges, the step's slot mapping,
a chunk's gathered context, the decode gather); the compiled and Triton kernels compute the same formula on
the device from the block tables they are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

Index = TypeVar("Index", int, np.ndarray, torch.Tensor)


def slot(block: Index, offset: Index, block_size: int) -> Index:
    """The cache slot of row `offset` of `block` (ints, or arrays or tensors that broadcast)."""
    out: Index = block * block_size + offset
    return out


def block_range(block: int, block_size: int) -> slice:
    """The cache slots of a whole block."""
    first = slot(block, 0, block_size)
    return slice(first, first + block_size)


def position_slots(table: Sequence[int], start: int, end: int, block_size: int) -> np.ndarray:
    """The cache slots of positions [start, end), int64, without a loop per token (a 512-token chunk on this
    project's 2-core machine: 76 us as a loop over positions, 15 us here)."""
    first = start // block_size
    blocks = np.asarray(table[first : (end - 1) // block_size + 1], dtype=np.int64)
    slots = slot(blocks[:, None], np.arange(block_size), block_size).ravel()
    offset = first * block_size
    out: np.ndarray = slots[start - offset : end - offset]
    return out


def table_slots(blocks: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """The cache slots of positions [0, length) of block tables `blocks` [..., width] (long): [..., length]."""
    offsets = torch.arange(block_size, device=blocks.device)
    slots = slot(blocks[..., None], offsets, block_size)
    return slots.flatten(-2)[..., :length]
