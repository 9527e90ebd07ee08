"""The decode graphs' inputs on the host: one row per running sequence, kept from step to step.

A decode step's inputs are each sequence's token, position, cache slot, context length and block table. The
block tables are the bulk (sequences x the context limit's blocks: 256 x 512 entries for SmolLM2 at 8k), and
building them anew every step is most of a step's host work. Here each sequence keeps its row while it runs:
a step writes its one token, position, slot and length, and only the block-table entries that changed (a new
block every `block_size` steps; the whole row when the sequence is new to its row or its table was replaced,
as on preemption). A sequence that leaves frees its row, and the last rows move into the gaps, so that the
live rows stay rows 0..n-1 (the batch bucket's first n). `perm` maps the plan's order to rows: the graph
returns its logits through it, in plan order.

On CUDA the buffers are pinned, so the copies to the graph's device buffers are asynchronous. Each step reads
its sampled tokens back before the next step stages, so no buffer is rewritten under a copy still in flight
(an overlapped loop would need two sets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmserve.engine.plan import SeqStep


@dataclass(slots=True, eq=False)
class _Row:
    seq_no: int
    table: Sequence[int]  # the block table list the row was written from (a replaced table is a new list)
    written: int  # its entries [0, written) are in the row


class DecodeRows:
    """Host buffers of the decode inputs for up to `max_batch` sequences, rows kept per sequence."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, pad_block: int, pad_slot: int, *, pin: bool):
        def buffer(*shape: int, dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, pin_memory=pin)

        self.block_size = block_size
        self.pad_block = pad_block
        self.pad_slot = pad_slot
        self.ids = buffer(max_batch, dtype=torch.long)
        self.positions = buffer(max_batch, dtype=torch.long)
        self.slots = buffer(max_batch, dtype=torch.long, fill=pad_slot)
        self.perm = torch.arange(max_batch, dtype=torch.long).pin_memory() if pin else torch.arange(max_batch)
        self.lens = buffer(max_batch, dtype=torch.int32, fill=1)
        self.tables = buffer(max_batch, max_blocks, dtype=torch.int32, fill=pad_block)
        # NumPy views of the same memory: element and slice writes without a torch call each.
        self._ids, self._positions, self._slots = self.ids.numpy(), self.positions.numpy(), self.slots.numpy()
        self._perm, self._lens, self._tables = self.perm.numpy(), self.lens.numpy(), self.tables.numpy()
        self._rows: list[_Row | None] = [None] * max_batch
        self._row_of: dict[int, int] = {}  # seq_no -> its row
        self._used = 0  # rows [0, _used) may hold a sequence or padding written by the last stage
        self.entries_written = 0  # block-table entries written, all steps (the tests read it)

    def stage(self, seqs: Sequence[SeqStep], padded: int) -> None:
        """Write a decode step's inputs (one token per sequence): live rows 0..n-1, padding rows n..padded-1
        (one token at the pad slot, attending to itself), perm[i] = the row of seqs[i]."""
        n = len(seqs)
        rows, row_of = self._rows, self._row_of
        here = {s.seq.seq_no for s in seqs}
        for seq_no in [k for k in row_of if k not in here]:
            rows[row_of.pop(seq_no)] = None
        free = [r for r in range(n) if rows[r] is None]
        free.reverse()  # fill the lowest rows first
        for r in range(n, self._used):  # a sequence beyond row n moves into a gap below it
            moving = rows[r]
            if moving is not None:
                self._move(r, free.pop(), moving)
        bs = self.block_size
        tables = self._tables
        order: list[int] = []
        for step in seqs:
            seq_no = step.seq.seq_no
            row = row_of.get(seq_no)
            table = step.block_table
            need = step.start // bs + 1  # blocks up to the one this step writes into
            if row is None:
                row = free.pop()
                row_of[seq_no] = row
                rows[row] = book = _Row(seq_no, table, 0)
            else:
                book = rows[row]  # type: ignore[assignment]
                if book.table is not table:
                    book.table, book.written = table, 0
            if book.written < need:
                tables[row, book.written : need] = table[book.written : need]
                self.entries_written += need - book.written
                book.written = need
            order.append(row)
        self._ids[order] = [s.token_ids[0] for s in seqs]
        self._positions[order] = [s.start for s in seqs]
        self._slots[order] = [s.block_table[s.start // bs] * bs + s.start % bs for s in seqs]
        self._lens[order] = [s.start + 1 for s in seqs]
        self._perm[:n] = order
        pad = slice(n, padded)
        self._ids[pad] = 0
        self._positions[pad] = 0
        self._slots[pad] = self.pad_slot
        self._lens[pad] = 1
        self._perm[pad] = range(n, padded)
        tables[pad, 0] = self.pad_block
        self._used = padded

    def _move(self, src: int, dst: int, book: _Row) -> None:
        self._tables[dst, : book.written] = self._tables[src, : book.written]
        self._rows[dst], self._rows[src] = book, None
        self._row_of[book.seq_no] = dst
