"""The varlen path's step inputs: device buffers allocated once, filled from pinned host staging.

Every step of the torch and CUDA backends with the varlen kernel (prompt chunks and decodes alike, eager or
replayed from a CUDA graph) reads its inputs from the same device buffers, allocated when the backend is built:
the packed row's token ids, positions and cache slots, the rows whose logits are kept, each sequence's query
start and context length, and the block tables by row. A step writes its values into pinned host staging (NumPy
over the pinned memory; no loop per token) and sends them with three non-blocking copies: the 64-bit values, the
32-bit values, and the live rows of the block tables, whose host side is the input batch's own (kept per
sequence, input_batch.py). A captured graph holds views of these buffers at the offsets its bucket gives, so the
graphs own no input buffers and a step is staged once, whatever runs it.

One step of T tokens (padding included), K kept rows and S sequences (padding rows included) lies as:

    int64   ids [0, T) | positions [T, 2T) | slots [2T, 3T) | keep [3T, 3T + K)
    int32   query_start [0, S + 1) | seq_lens [S + 1, 2S + 1)
    tables  rows [0, S) of [max_seqs, max_blocks]

The packed row follows the input batch's rows: sequence i of the step is row i, its block table row i. The layout
depends on (T, K, S) alone, so a graph captured for a bucket finds its inputs where it captured them.

Padding, for a graph's fixed sizes: `rows_to` adds one-token sequences (id 0 at position 0, written to the scratch
slot, attending to it alone) up to a batch bucket; `tokens_to` adds tokens outside every sequence (the scratch
slot, attended by nobody) up to a token bucket.

The staging is rewritten only once the previous step's copies are done (an event on CUDA), so a loop that stages
step N+1 while step N runs never writes under a copy in flight.

Room left for what comes next: a sequence may compute several tokens in a step wherever it is (speculative
decoding's draft tokens are counts > 1 like a prompt chunk's), and a per-row value (a LoRA adapter index) is one
more row-ordered region beside seq_lens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from llmserve.engine.backends.attention import VarlenAttention, VarlenKernel
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.input_batch import InputBatch
from llmserve.engine.backends.slots import slot
from llmserve.engine.sched.plan import SeqStep


@dataclass(slots=True, frozen=True)
class Layout:
    """Where one step lies in the buffers: T tokens, K kept rows, S sequences (padding included)."""

    tokens: int
    kept: int
    seqs: int
    max_query_len: int


@dataclass(slots=True)
class StepInputs:
    """One step's forward inputs: views of the device buffers."""

    input_ids: torch.Tensor  # [1, T] long
    positions: torch.Tensor  # [1, T] long
    keep: torch.Tensor  # [K] long: the packed rows whose logits come back, in plan.sampling order
    attention: VarlenAttention


class StepBuffers:
    """The device buffers and their host staging for steps of up to `max_tokens` tokens and the input batch's
    sequences; see the module docstring."""

    def __init__(self, inputs: InputBatch, kv: KVCache, kernel: VarlenKernel, max_tokens: int) -> None:
        self.inputs = inputs
        self.kv = kv
        self.kernel = kernel
        self.device = kv.tensor.device
        self.block_size = inputs.block_size
        max_seqs, max_blocks = inputs.tables.shape
        self.max_tokens = max(max_tokens, max_seqs)  # a padded decode step has a token per row
        self.max_seqs = max_seqs
        pin = self.device.type == "cuda"
        n64, n32 = 3 * self.max_tokens + max_seqs, 2 * max_seqs + 1
        self._host64 = torch.zeros(n64, dtype=torch.long, pin_memory=pin)
        self._host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self._h64, self._h32 = self._host64.numpy(), self._host32.numpy()
        self._tables = inputs.tables.numpy()
        # The device side; on the CPU (the emulation) separate buffers all the same, so the copies run there too.
        self.d64 = torch.zeros(n64, dtype=torch.long, device=self.device)
        self.d32 = torch.zeros(n32, dtype=torch.int32, device=self.device)
        self.d_tables = torch.full((max_seqs, max_blocks), inputs.pad_block, dtype=torch.int32, device=self.device)
        # Host scratch by row (not sent): each step's token counts and first positions.
        self._counts = np.zeros(max_seqs, dtype=np.int64)
        self._starts = np.zeros(max_seqs, dtype=np.int64)
        self._arange = np.arange(self.max_tokens + 1, dtype=np.int64)
        self._copied: torch.cuda.Event | None = None
        self.rows = np.zeros(0, dtype=np.int64)  # the last write's entries' rows, in its order
        self.bytes = sum(t.numel() * t.element_size() for t in (self.d64, self.d32, self.d_tables))

    def write(self, entries: Sequence[SeqStep], *, rows_to: int | None = None, tokens_to: int | None = None) -> Layout:
        """Stage `entries` (placed in the input batch's rows) and start their copies to the device; pad the
        sequences to `rows_to` or the tokens to `tokens_to` (see the module docstring). Returns the layout."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies read the staging we are about to rewrite
        inputs, bs = self.inputs, self.block_size
        n = len(entries)
        seqs = n if rows_to is None else rows_to
        if seqs > self.max_seqs or seqs < n:
            raise ValueError(f"{n} sequences padded to {seqs}: at most {self.max_seqs} rows")
        rows = self.rows = np.asarray(inputs.place(entries), dtype=np.int64)
        counts, starts = self._counts[:seqs], self._starts[:seqs]
        counts[n:], starts[n:] = 1, 0  # padding rows: one token at position 0
        counts[rows], starts[rows] = inputs.counts, inputs.starts
        h32 = self._h32
        query_start = h32[: seqs + 1]
        query_start[0] = 0
        np.cumsum(counts, out=query_start[1:])
        np.add(starts, counts, out=h32[seqs + 1 : 2 * seqs + 1])  # context lengths once the step is done
        real = int(query_start[seqs])  # tokens that belong to a sequence (padding rows' included)
        tokens = real if tokens_to is None else tokens_to
        if tokens > self.max_tokens or tokens < real:
            raise ValueError(f"{real} tokens padded to {tokens}: at most {self.max_tokens}")
        h64 = self._h64
        ids, positions, slots = h64[:tokens], h64[tokens : 2 * tokens], h64[2 * tokens : 3 * tokens]
        tables = self._tables
        tables[n:seqs, 0] = inputs.pad_block  # padding rows read and write the scratch block
        live = int(query_start[n])  # the live rows' tokens come first (rows 0..n-1)
        if real == seqs:  # one token per sequence (decode): by row, no per-token arrays
            ids[rows] = [e.token_ids[0] for e in entries]
            ids[n:seqs] = 0
            positions[:seqs] = starts
            row_of = self._arange[:seqs]
        else:
            row_of = np.repeat(self._arange[:seqs], counts)
            np.add(starts[row_of], self._arange[:real] - query_start[row_of], out=positions[:real])
            in_rows = np.empty(n, dtype=np.int64)
            in_rows[rows] = self._arange[:n]  # the entry in each row
            order = [entries[i].token_ids for i in in_rows.tolist()]
            ids[:live] = np.fromiter(chain.from_iterable(order), dtype=np.int64, count=live)
            ids[live:real] = 0
        at = positions[:real]
        slots[:real] = slot(tables[row_of, at // bs].astype(np.int64), at % bs, bs)
        ids[real:], positions[real:], slots[real:] = 0, 0, inputs.pad_slot  # tokens outside every sequence
        last = query_start[1:] - 1  # each row's last token
        if rows_to is not None:  # a graph keeps every row's logits, the plan's first, in plan order
            kept = seqs
            keep = h64[3 * tokens : 3 * tokens + kept]
            keep[:n] = last[rows]
            keep[n:] = last[n:]
        else:
            sampling = np.fromiter((e.sample is not None for e in entries), dtype=bool, count=n)
            chosen = last[rows[sampling]]  # the sampling entries' last tokens, in plan order
            kept = len(chosen)
            h64[3 * tokens : 3 * tokens + kept] = chosen
        self._send(3 * tokens + kept, 2 * seqs + 1, seqs)
        return Layout(tokens, kept, seqs, int(counts.max()) if seqs else 0)

    def inputs_of(self, layout: Layout) -> StepInputs:
        """The device views a step of this layout reads (a graph captures them once per bucket)."""
        t, k, s = layout.tokens, layout.kept, layout.seqs
        d64, d32 = self.d64, self.d32
        attention = VarlenAttention(
            kv=self.kv.tensor,
            slot_mapping=d64[2 * t : 3 * t],
            kernel=self.kernel,
            query_start=d32[: s + 1],
            seq_lens=d32[s + 1 : 2 * s + 1],
            block_tables=self.d_tables[:s],
            max_query_len=layout.max_query_len,
            block_size=self.block_size,
        )
        return StepInputs(d64[:t].view(1, t), d64[t : 2 * t].view(1, t), d64[3 * t : 3 * t + k], attention)

    def stage(self, entries: Sequence[SeqStep]) -> StepInputs:
        """An eager step's inputs: `write`, then the views of its layout."""
        return self.inputs_of(self.write(entries))

    def _send(self, n64: int, n32: int, rows: int) -> None:
        cuda = self.device.type == "cuda"
        self.d64[:n64].copy_(self._host64[:n64], non_blocking=cuda)
        self.d32[:n32].copy_(self._host32[:n32], non_blocking=cuda)
        self.d_tables[:rows].copy_(self.inputs.tables[:rows], non_blocking=cuda)
        if cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()
