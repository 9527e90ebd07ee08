"""Every step's inputs on the host, in one persistent batch: a row per running sequence, kept from step to step.

A step's inputs are each sequence's tokens, positions, cache slots, context length and block table. The block
tables are the bulk (sequences x the context limit's blocks: 256 x 512 entries for SmolLM2 at 8k), and
building them anew every step was most of a step's host work. Here each sequence keeps its row while it runs:
a step writes only the block-table entries that changed (a new block every `block_size` steps; the whole row
when the sequence is new to its row or its table was replaced, as on preemption or re-admission). A sequence
that leaves frees its row, and the last rows move into the gaps, so that the live rows are always rows 0..n-1.

Every backend path reads the same batch:
- `place` gives each of a step's entries its row and brings the row's block table up to date; `starts` and
  `counts` are then each entry's first position and token count. The varlen path (step_buffers.py: the torch and
  CUDA backends with the Triton kernel, eager steps and CUDA graphs alike) stages everything else from these,
  in row order, and sends the live rows of `tables` (pinned on CUDA) to the device as they are.
- `stage` (the gathered and compiled-kernel paths, the CPU's): the packed row's tokens, positions and slots in the
  order the backend packs the entries, each entry's row, context length and query range; the attention metadata
  takes the block tables of those rows (`tables_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.engine.backends.slots import position_slots, slot
from llmserve.engine.sched.plan import SeqStep


@dataclass(slots=True, eq=False)
class _Row:
    seq_no: int
    table: Sequence[int]  # the block table list the row was written from (a replaced table is a new list)
    written: int  # its entries [0, written) are in the row


@dataclass(slots=True)
class Staged:
    """One eager step's inputs, entries in packed-row order (CPU tensors; the backend moves them).

    Entry i computes packed positions [query_start[i], query_start[i + 1]), has context `lens[i]` once the step
    is done, and its block table is row `rows[i]` of the batch.
    """

    entries: Sequence[SeqStep]
    ids: torch.Tensor  # [tokens] long
    positions: torch.Tensor  # [tokens] long
    slots: torch.Tensor  # [tokens] long: where each new token's K/V goes
    rows: np.ndarray  # [seqs] int64
    lens: np.ndarray  # [seqs] int32
    query_start: np.ndarray  # [seqs + 1] int32
    max_query_len: int
    widths: np.ndarray  # [seqs] int64: blocks each entry's context spans
    num_decode: int  # the entries at the front that compute one token each
    num_verify: int = 0  # the entries after those that verify drafts (their last token and the drafts)


class InputBatch:
    """Host buffers of the step inputs for up to `max_seqs` sequences of up to `max_blocks` blocks each."""

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, pad_block: int, pad_slot: int, *, pin: bool):
        def buffer(*shape: int, dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, pin_memory=pin)

        self.block_size = block_size
        self.pad_block = pad_block
        self.pad_slot = pad_slot
        self.tables = buffer(max_seqs, max_blocks, dtype=torch.int32, fill=pad_block)
        self._tables = self.tables.numpy()  # a NumPy view of the same memory: slice writes without a torch call
        self._rows: list[_Row | None] = [None] * max_seqs
        self._row_of: dict[int, int] = {}  # seq_no -> its row
        self._used = 0  # rows [0, _used) may hold a sequence
        self.entries_written = 0  # block-table entries written, all steps (the tests read it)
        self.starts: list[int] = []  # the last place()'s entries' first positions and token counts, in its order
        self.counts: list[int] = []

    # -- the rows ------------------------------------------------------------------------------

    def place(self, entries: Sequence[SeqStep]) -> list[int]:
        """Give every entry its row (rows 0..len(entries)-1), free the rows of sequences not among them, and
        bring each row's block table up to the blocks the entry's step writes into. Returns the rows, in
        `entries` order."""
        n = len(entries)
        rows, row_of = self._rows, self._row_of
        free: list[int] = []
        # The same sequences as last step (the common case in a decode stretch): nothing joins, leaves or moves.
        same = len(row_of) == n and all(s.seq.seq_no in row_of for s in entries)
        if not same:
            here = {s.seq.seq_no for s in entries}
            for seq_no in [k for k in row_of if k not in here]:
                rows[row_of.pop(seq_no)] = None
            free = [r for r in range(n) if rows[r] is None]
            free.reverse()  # fill the lowest rows first
            for r in range(n, self._used):  # a sequence beyond row n moves into a gap below it
                moving = rows[r]
                if moving is not None:
                    self._move(r, free.pop(), moving)
        self._used = n
        bs = self.block_size
        tables = self._tables
        order: list[int] = []
        starts, counts = self.starts, self.counts
        starts.clear()
        counts.clear()
        for step in entries:
            seq_no = step.seq.seq_no
            row = row_of.get(seq_no)
            table = step.block_table
            start, count = step.start, len(step.token_ids)
            starts.append(start)
            counts.append(count)
            need = (start + count - 1) // bs + 1  # blocks up to the last one this step writes
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
        return order

    def _move(self, src: int, dst: int, book: _Row) -> None:
        self._tables[dst, : book.written] = self._tables[src, : book.written]
        self._rows[dst], self._rows[src] = book, None
        self._row_of[book.seq_no] = dst

    def tables_of(self, rows: np.ndarray, width: int) -> torch.Tensor:
        """The block tables of `rows`, in that order, cut to `width` blocks: a [len(rows), width] int32 copy.
        Entries past a row's context are stale (never read past a length, or masked)."""
        return torch.from_numpy(np.ascontiguousarray(self._tables[rows, :width]))

    # -- one step's inputs -------------------------------------------------------------------------

    def stage(self, entries: Sequence[SeqStep]) -> Staged:
        """The inputs of an eager forward over `entries`, packed in that order (one-token entries first)."""
        rows = np.asarray(self.place(entries), dtype=np.int64)
        n = len(entries)
        bs = self.block_size
        starts = np.array(self.starts, dtype=np.int64)
        counts = np.array(self.counts, dtype=np.int64)
        lens = starts + counts
        query_start = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        max_query_len = int(counts.max())
        if max_query_len == 1:  # decode only: one token each, slots from the rows just written
            ids = np.array([e.token_ids[0] for e in entries], dtype=np.int64)
            positions = starts
            slots = slot(self._tables[rows, starts // bs].astype(np.int64), starts % bs, bs)
        else:
            ids = np.empty(int(query_start[-1]), dtype=np.int64)
            positions = np.empty_like(ids)
            slots = np.empty_like(ids)
            one = counts == 1
            if one.any():  # the decodes among the chunks: at once, as above
                singles = np.flatnonzero(one)
                at = query_start[singles]
                ids[at] = [entries[i].token_ids[0] for i in singles.tolist()]
                positions[at] = starts[singles]
                blocks = self._tables[rows[singles], starts[singles] // bs].astype(np.int64)
                slots[at] = slot(blocks, starts[singles] % bs, bs)
            for i in np.flatnonzero(~one).tolist():
                entry = entries[i]
                q0, q1, start = int(query_start[i]), int(query_start[i + 1]), int(starts[i])
                ids[q0:q1] = entry.token_ids
                positions[q0:q1] = np.arange(start, start + q1 - q0)
                slots[q0:q1] = position_slots(entry.block_table, start, start + q1 - q0, bs)
        return Staged(
            entries=entries,
            ids=torch.from_numpy(ids),
            positions=torch.from_numpy(positions),
            slots=torch.from_numpy(slots),
            rows=rows,
            lens=lens.astype(np.int32),
            query_start=query_start,
            max_query_len=max_query_len,
            widths=(lens - 1) // bs + 1,
            num_decode=self.counts.count(1),
            num_verify=sum(1 for e in entries if e.drafts),
        )
