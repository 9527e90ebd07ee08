"""A step's attention metadata, built from the persistent input batch: one builder per attention kernel.

A backend is composed with one builder, chosen when it is built: `GatheredBuilder` (torch attention; on the
CPU with decode groups by context length and long chunks in query blocks), `KernelDecodeBuilder` (the CPU's
compiled decode kernel). The Triton varlen kernel's steps need no builder: their metadata are views of
persistent device buffers (step_buffers.py). Each builder reads the step as `input_batch.Staged`
(entries in packed order: one-token entries first, shortest context first, then prompt chunks) and the block
tables of its rows, and returns the metadata type of its kernel (attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from llmserve.engine.backends.attention import (
    AttentionMetadata,
    Chunk,
    DecodeGroup,
    GatheredAttention,
    KernelDecodeAttention,
    QueryBlock,
)
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.input_batch import InputBatch, Staged
from llmserve.engine.backends.slots import table_slots

if TYPE_CHECKING:
    from llmserve.engine.backends.cpu.native import PagedDecode

# CPU: a long chunk's queries attend in blocks of this many rows, each to the keys up to its last query.
# transformers' CPU flash attention does nearly the full square's work under a causal mask; blocks skip
# most of the upper triangle. Measured (SmolLM2's heads, 464 queries after 16 cached tokens): one call
# 6.8 ms, blocks of 64 rows 5.1 ms; 128 and 256 rows fall in between.
QUERY_BLOCK = 64


class MetadataBuilder(Protocol):
    """Builds one step's attention metadata for one kernel."""

    def build(self, staged: Staged, slot_mapping: torch.Tensor) -> AttentionMetadata: ...


class GatheredBuilder:
    """Metadata for the torch attention. `grouped`: decode rows in groups whose padding wastes at most ~1/3 of
    their reads (the CPU), else one group; `query_blocks`: chunks longer than QUERY_BLOCK attend block by block
    (the CPU)."""

    def __init__(
        self, inputs: InputBatch, kv: KVCache, dtype: torch.dtype, *, grouped: bool = False, query_blocks: bool = False
    ) -> None:
        self.inputs = inputs
        self.kv = kv
        self.dtype = dtype
        self.device = kv.tensor.device
        self.grouped = grouped
        self.query_blocks = query_blocks

    def build(self, staged: Staged, slot_mapping: torch.Tensor) -> GatheredAttention:
        num = decode_count(staged)
        return GatheredAttention(
            self.kv.tensor, slot_mapping, self.decode_groups(staged, num), self.chunks(staged, num)
        )

    def decode_groups(self, staged: Staged, num: int) -> list[DecodeGroup]:
        """Decode rows [0, num) of the packed row (sorted by context length) as padded gathered groups."""
        if num == 0:
            return []
        lens = staged.lens[:num].tolist()
        bounds = [0]
        while bounds[-1] < num:
            start = bounds[-1]
            end = start + 1
            if not self.grouped:
                end = num
            while end < num and lens[end] * 2 <= lens[start] * 3 + 2 * self.kv.block_size:
                end += 1
            bounds.append(end)
        groups = []
        for start, end in zip(bounds, bounds[1:], strict=False):
            ctx = max(lens[start:end])
            width = -(-ctx // self.kv.block_size)
            tables = self.inputs.tables_of(staged.rows[start:end], width)
            slots, bias = self.decode_tensors(tables, staged.lens[start:end], ctx)
            groups.append(DecodeGroup(start, end, slots, bias, ctx))
        return groups

    def decode_tensors(
        self, tables: torch.Tensor, lens: np.ndarray | torch.Tensor, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather slots [len(tables) * ctx] and additive mask [kv_heads * len(tables), 1, ctx] for decode rows
        whose block tables (a host tensor at least ctx's blocks wide; entries past a length are not read) and
        context lengths these are."""
        dev = self.device
        n = len(tables)
        blocks = tables[:, : -(-ctx // self.kv.block_size)].to(dev, torch.long)
        slots = table_slots(blocks, self.kv.block_size, ctx)
        lens_t = torch.as_tensor(lens).to(dev, torch.long)
        bias = torch.zeros(n, ctx, dtype=self.dtype, device=dev)
        bias.masked_fill_(torch.arange(ctx, device=dev)[None, :] >= lens_t[:, None], float("-inf"))
        kvh = self.kv.shape.num_kv_heads
        return slots.reshape(-1), bias.repeat(kvh, 1).view(kvh * n, 1, ctx)

    def chunks(self, staged: Staged, first: int) -> list[Chunk]:
        """The prompt chunks: entries [first, len) of the packed row."""
        out = []
        for i in range(first, len(staged.entries)):
            q0, q1 = int(staged.query_start[i]), int(staged.query_start[i + 1])
            out.append(self.chunk(q0, q1, staged.entries[i].start, staged.entries[i].block_table))
        return out

    def chunk(self, q_start: int, q_end: int, ctx_start: int, table: Sequence[int]) -> Chunk:
        """A prompt chunk at rows [q_start, q_end) of the packed row, after `ctx_start` cached tokens, of a
        sequence with this block table."""
        ctx = ctx_start + (q_end - q_start)
        blocked = self.query_blocks and q_end - q_start > QUERY_BLOCK
        if ctx_start == 0 and not blocked:
            return Chunk(q_start, q_end, None, None)  # plain causal attention over its own keys
        context = self.context_slots(table, ctx) if ctx_start > 0 else None
        if blocked:
            return Chunk(q_start, q_end, context, None, self.blocks(ctx_start, ctx))
        q_pos = torch.arange(ctx_start, ctx, device=self.device)
        mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]
        return Chunk(q_start, q_end, context, mask)

    def context_slots(self, table: Sequence[int], ctx: int) -> torch.Tensor:
        """The cache slots of positions [0, ctx) of a sequence with this block table."""
        width = -(-ctx // self.kv.block_size)
        blocks = torch.tensor(list(table[:width]), dtype=torch.long, device=self.device)
        return table_slots(blocks, self.kv.block_size, ctx)

    def blocks(self, ctx_start: int, ctx: int) -> list[QueryBlock]:
        """The queries of positions [ctx_start, ctx) in blocks of QUERY_BLOCK rows, each with its mask."""
        positions = torch.arange(ctx)
        blocks = []
        for start in range(0, ctx - ctx_start, QUERY_BLOCK):
            end = min(ctx - ctx_start, start + QUERY_BLOCK)
            keys = ctx_start + end
            hidden = positions[None, :keys] > positions[ctx_start + start : keys, None]
            # Additive, in the model's dtype: a boolean mask is converted on every call, in every layer.
            mask = torch.zeros(end - start, keys, dtype=self.dtype).masked_fill_(hidden, float("-inf"))
            blocks.append(QueryBlock(start, end, keys, mask))
        return blocks


class KernelDecodeBuilder:
    """Metadata for the CPU's compiled decode kernel: the decode rows' block tables and lengths as the kernel
    reads them; chunks as `chunks` (a GatheredBuilder) makes them.

    `every_token`: prompt chunks' tokens go through the kernel too, each as a query of its own over the context up
    to itself (the chunk's keys are in the cache before any layer attends). A token then gets bit for bit the
    attention it would get in a decode step, whatever chunk it was computed in, or whether a preempted or
    continued sequence computes it again: the batch invariance of the bfloat16 and int8 forwards, where SDPA's
    blocked softmax and the kernel round differently."""

    def __init__(
        self, inputs: InputBatch, kv: KVCache, kernel: PagedDecode, chunks: GatheredBuilder, every_token: bool = False
    ) -> None:
        self.inputs = inputs
        self.kv = kv
        self.kernel = kernel
        self._chunks = chunks
        self.every_token = every_token

    def build(self, staged: Staged, slot_mapping: torch.Tensor) -> KernelDecodeAttention:
        # The kernel's entries: the decodes; those verifying drafts (one query row per position, each with its own
        # length: causal attention by the same kernel and in the same order as decoding those tokens one by one);
        # with `every_token`, every entry, and no chunk is left for SDPA.
        num = len(staged.entries) if self.every_token else decode_count(staged) + staged.num_verify
        if num == decode_count(staged):  # one query per entry: its row and length as staged
            rows, lens = staged.rows[:num], staged.lens[:num]
        else:
            rows, lens = query_rows(staged, num)
        width = int(staged.widths[:num].max()) if num else 0
        return KernelDecodeAttention(
            kv=self.kv.tensor,
            slot_mapping=slot_mapping,
            kernel=self.kernel,
            num=len(rows),
            tables=self.inputs.tables_of(rows, width),
            lens=torch.from_numpy(lens),
            max_len=int(lens.max()) if len(lens) else 0,
            block_size=self.kv.block_size,
            chunks=self._chunks.chunks(staged, num),
        )


def query_rows(staged: Staged, num: int) -> tuple[np.ndarray, np.ndarray]:
    """Every query of entries [0, num) as a kernel row of its own: its entry's block-table row, and its context
    length (up to and including its own position, whose K/V the layer writes before attending)."""
    counts = np.diff(staged.query_start[: num + 1]).astype(np.int64)
    rows = np.repeat(staged.rows[:num], counts)
    # The query at offset j of an entry with c queries and final context L sees L - c + 1 + j positions.
    firsts = np.repeat(staged.lens[:num].astype(np.int64) - counts, counts)
    offsets = np.arange(len(rows), dtype=np.int64) - np.repeat(staged.query_start[:num].astype(np.int64), counts)
    return rows, (firsts + offsets + 1).astype(np.int32)


def decode_count(staged: Staged) -> int:
    """How many entries at the front of the packed row compute one token."""
    return staged.num_decode
