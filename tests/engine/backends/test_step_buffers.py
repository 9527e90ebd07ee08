"""The varlen path's persistent step buffers (backends/step_buffers.py): what a step stages into the device buffers
equals what the old path built for it (input_batch.InputBatch.stage on a fresh batch, which the varlen builder
read), entry by entry, whatever joins, leaves, prefills in chunks, decodes or has its table replaced; padding rows
and tokens write only the scratch slot; a bucket's views never move; a steady decode rewrites almost nothing."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.input_batch import InputBatch
from llmserve.engine.backends.step_buffers import StepBuffers, StepInputs
from llmserve.engine.sched.plan import SeqStep
from llmserve.engine.types.model import ModelShape

BS = 4
MAX_SEQS = 8
MAX_BLOCKS = 16
MAX_TOKENS = 40
NUM_BLOCKS = 60  # the scratch block is block 60
SHAPE = ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=100, context_length=64)


@dataclass
class _Seq:
    seq_no: int
    length: int  # tokens the sequence has (prompt, then one more per decode)
    computed: int = 0
    table: list[int] = field(default_factory=list)


def buffers() -> StepBuffers:
    kv = KVCache(SHAPE, NUM_BLOCKS, BS, torch.float32, torch.device("cpu"))
    inputs = InputBatch(MAX_SEQS, MAX_BLOCKS, BS, kv.scratch_block, kv.scratch_slot, pin=False)
    return StepBuffers(inputs, kv, lambda *a, **k: None, MAX_TOKENS)  # type: ignore[arg-type,return-value]


def token(seq_no: int, position: int) -> int:
    return 1000 * seq_no + position


def check_step(buf: StepBuffers, inputs: StepInputs, entries: list[SeqStep], padded_to: int | None = None) -> None:
    """The device buffers of this step, entry by entry, against the old path's packing of the same entries, and
    the padding against the scratch slot."""
    fresh = InputBatch(*buf.inputs.tables.shape, BS, buf.inputs.pad_block, buf.inputs.pad_slot, pin=False)
    old = fresh.stage(entries)
    meta = inputs.attention
    ids, positions, slots = inputs.input_ids[0].tolist(), inputs.positions[0].tolist(), meta.slot_mapping.tolist()
    query_start, seq_lens, tables = meta.query_start.tolist(), meta.seq_lens.tolist(), meta.block_tables
    n = len(entries)
    assert sorted(buf.rows.tolist()) == list(range(n))  # the live rows are 0..n-1, in any order
    for i, entry in enumerate(entries):
        row = int(buf.rows[i])
        q0, q1 = query_start[row], query_start[row + 1]
        o0, o1 = int(old.query_start[i]), int(old.query_start[i + 1])
        assert ids[q0:q1] == old.ids[o0:o1].tolist() == list(entry.token_ids)
        assert positions[q0:q1] == old.positions[o0:o1].tolist() == list(range(entry.start, entry.end))
        assert slots[q0:q1] == old.slots[o0:o1].tolist()
        assert seq_lens[row] == int(old.lens[i]) == entry.end
        width = int(old.widths[i])
        assert tables[row, :width].tolist() == fresh.tables_of(old.rows[i : i + 1], width)[0].tolist()
    if padded_to is None:
        sampling = [i for i, e in enumerate(entries) if e.sample is not None]
        assert inputs.keep.tolist() == [query_start[int(buf.rows[i]) + 1] - 1 for i in sampling]
        assert meta.max_query_len == max((len(e.token_ids) for e in entries), default=0)
    else:  # a decode graph's: every row's logits, the plan's entries first, in plan order
        assert inputs.keep.tolist()[:n] == [query_start[int(buf.rows[i]) + 1] - 1 for i in range(n)]
        assert sorted(inputs.keep.tolist()) == list(range(padded_to))
        for row in range(n, padded_to):  # padding rows: one token at the scratch slot, attending to itself
            q0 = query_start[row]
            assert query_start[row + 1] == q0 + 1 and seq_lens[row] == 1 and tables[row, 0] == buf.inputs.pad_block
            assert (ids[q0], positions[q0], slots[q0]) == (0, 0, buf.inputs.pad_slot)
    real = query_start[len(seq_lens)]
    assert all(s == buf.inputs.pad_slot for s in slots[real:])  # tokens outside every sequence


class StepLife(RuleBasedStateMachine):
    """A scheduler's life in miniature, each step staged into the buffers and compared with the old path."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = buffers()
        self.free = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(self.free)  # blocks scattered over the pool
        self.live: list[_Seq] = []
        self.seq_nos = iter(range(1, 10**6))

    @precondition(lambda self: len(self.live) < MAX_SEQS)
    @rule(prompt=st.integers(1, 30), at=st.integers(0, MAX_SEQS))
    def join(self, prompt: int, at: int) -> None:
        self.live.insert(min(at, len(self.live)), _Seq(next(self.seq_nos), prompt))

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, MAX_SEQS - 1))
    def leave(self, which: int) -> None:
        seq = self.live.pop(which % len(self.live))
        self.free.extend(seq.table)

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, MAX_SEQS - 1))
    def preempt(self, which: int) -> None:
        """Its blocks freed; re-admitted later with a new table (a new list) to recompute."""
        seq = self.live[which % len(self.live)]
        self.free.extend(seq.table)
        seq.table, seq.computed = [], 0

    @precondition(lambda self: self.live)
    @rule(
        chunks=st.lists(st.sampled_from([1, 2, 3, 5, 8, 30]), min_size=MAX_SEQS, max_size=MAX_SEQS),
        order=st.randoms(use_true_random=False),
        sample_all=st.booleans(),
    )
    def step(self, chunks: list[int], order: random.Random, sample_all: bool) -> None:
        entries, budget = [], MAX_TOKENS
        for seq, chunk in zip(self.live, chunks, strict=False):
            if seq.computed == seq.length:
                seq.length += 1  # it sampled last step: one more token to compute
            n = min(seq.length - seq.computed, chunk, budget)
            need = (seq.computed + n - 1) // BS + 1 - len(seq.table)
            if n <= 0 or seq.computed + n > MAX_BLOCKS * BS or need > len(self.free):
                continue
            seq.table = seq.table if seq.table else []
            seq.table.extend(self.free.pop() for _ in range(need))
            ids = [token(seq.seq_no, p) for p in range(seq.computed, seq.computed + n)]
            samples = sample_all or seq.computed + n == seq.length
            entries.append(SeqStep(seq, seq.computed, ids, seq.table, object() if samples else None))  # type: ignore[arg-type]
            budget -= n
        if not entries:
            return
        order.shuffle(entries)  # the plan's order is the scheduler's; the rows need not follow it
        decode_graph = all(len(e.token_ids) == 1 for e in entries) and order.random() < 0.5
        if decode_graph:
            padded = next(b for b in (1, 2, 4, 8) if b >= len(entries))
            layout = self.buf.write(entries, rows_to=padded)
            check_step(self.buf, self.buf.inputs_of(layout), entries, padded)
        else:
            tokens = sum(len(e.token_ids) for e in entries)
            pad = order.choice([None, min(MAX_TOKENS, tokens + order.randrange(4))])
            inputs = self.buf.inputs_of(self.buf.write(entries, tokens_to=pad))
            check_step(self.buf, inputs, entries)
            assert inputs.input_ids.shape[1] == (pad or tokens)
        for entry in entries:
            entry.seq.computed = entry.end  # type: ignore[attr-defined]

    @invariant()
    def blocks_are_owned_once(self) -> None:
        held = [b for s in self.live for b in s.table] + self.free
        assert sorted(held) == list(range(NUM_BLOCKS))


TestStepLife = StepLife.TestCase
TestStepLife.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_buckets_views_are_where_its_graph_captured_them() -> None:
    """A graph captures the views of its bucket once; every later step of that bucket writes exactly there, into
    buffers allocated once."""
    buf = buffers()
    ptrs = (buf.d64.data_ptr(), buf.d32.data_ptr(), buf.d_tables.data_ptr())
    captured = buf.inputs_of(buf.write([], rows_to=4))
    seqs = [_Seq(i, 9, table=list(range(3 * i, 3 * i + 3))) for i in range(3)]
    entries = [SeqStep(s, 8, [token(s.seq_no, 8)], s.table, object()) for s in seqs]  # type: ignore[arg-type]
    again = buf.inputs_of(buf.write(entries, rows_to=4))
    for a, b in zip(_tensors(captured), _tensors(again), strict=True):
        assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
    check_step(buf, captured, entries, 4)  # the captured views see this step's values
    assert (buf.d64.data_ptr(), buf.d32.data_ptr(), buf.d_tables.data_ptr()) == ptrs


def _tensors(step: StepInputs) -> list[torch.Tensor]:
    m = step.attention
    return [step.input_ids, step.positions, step.keep, m.slot_mapping, m.query_start, m.seq_lens, m.block_tables]


def test_a_steady_decode_writes_only_new_blocks() -> None:
    """64 sequences decoding 32 steps: one table entry per block a sequence grows into, not the whole tables every
    step; one leaving from the front moves the last row into its gap and leaves the others where they are."""
    kv = KVCache(SHAPE, 2000, BS, torch.float32, torch.device("cpu"))
    buf = StepBuffers(InputBatch(64, 32, BS, kv.scratch_block, kv.scratch_slot, pin=False), kv, None, 64)  # type: ignore[arg-type]
    seqs = [_Seq(i, 41, table=list(range(i * 20, i * 20 + 11))) for i in range(64)]

    def decode() -> list[SeqStep]:
        return [SeqStep(s, s.length - 1, [token(s.seq_no, s.length - 1)], s.table, object()) for s in seqs]  # type: ignore[arg-type]

    buf.write(decode(), rows_to=64)
    first = buf.inputs.entries_written
    assert first == sum((s.length - 1) // BS + 1 for s in seqs)
    for _ in range(32):
        for seq in seqs:
            seq.length += 1
            while len(seq.table) <= (seq.length - 1) // BS:
                seq.table.append(len(seq.table) + 1000)
        entries = decode()
        check_step(buf, buf.inputs_of(buf.write(entries, rows_to=64)), entries, 64)
    assert buf.inputs.entries_written - first == 64 * 32 // BS
    before = buf.rows.tolist()
    seqs.pop(0)
    buf.write(decode(), rows_to=64)
    after = buf.rows.tolist()
    assert after[:62] == before[1:63] and after[62] == before[0]


def test_more_than_the_buffers_hold_is_refused() -> None:
    buf = buffers()
    with pytest.raises(ValueError, match="at most 8 rows"):
        buf.write([], rows_to=MAX_SEQS + 1)
    seq = _Seq(1, 50, table=list(range(13)))
    with pytest.raises(ValueError, match="at most 40"):
        buf.write([SeqStep(seq, 0, list(range(41)), seq.table, None)])  # type: ignore[arg-type]


def _steps(n_seqs: int, chunk: int, *, decode: bool = False) -> tuple[StepBuffers, list[SeqStep]]:
    """Buffers with `n_seqs` sequences placed (their tables written), and a step of theirs: each one token
    (decode) or a `chunk`-token prompt chunk."""
    buf = buffers()
    seqs = [_Seq(i, 40, table=list(range(5 * i, 5 * i + 5))) for i in range(n_seqs)]
    if decode:
        entries = [SeqStep(s, 12, [token(s.seq_no, 12)], s.table, object()) for s in seqs]  # type: ignore[arg-type]
    else:
        entries = [
            SeqStep(s, 0, [token(s.seq_no, p) for p in range(chunk)], s.table, object())  # type: ignore[arg-type]
            for s in seqs
        ]
    buf.write(entries)  # the rows and their tables in place: what follows is a steady step
    return buf, entries


@pytest.mark.parametrize("decode", [False, True])
def test_staging_a_step_allocates_no_tensor(decode: bool) -> None:
    """A step's staging and its views take no memory from torch's allocator (on CUDA it would be device memory
    every step): the values go into the staging allocated at start and are copied into the buffers in place."""
    from torch.profiler import ProfilerActivity, profile

    buf, entries = _steps(4, 8, decode=decode)
    ptrs = (buf.d64.data_ptr(), buf.d32.data_ptr(), buf.d_tables.data_ptr())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(3):
            step = buf.inputs_of(buf.write(entries, rows_to=8 if decode else None, tokens_to=None))
    allocations = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations == []
    assert (buf.d64.data_ptr(), buf.d32.data_ptr(), buf.d_tables.data_ptr()) == ptrs
    for t in _tensors(step):  # every input the forward reads is a view of the buffers allocated at start
        assert t.untyped_storage().data_ptr() in ptrs
    check_step(buf, step, entries, 8 if decode else None)
    # The probe sees allocations where there are some (so the empty list above means none).
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.from_numpy(buf._h64[:8]).clone()
    assert any(e.cpu_memory_usage > 0 for e in prof.events())


def _lines_run(run: object) -> int:
    """Python lines executed in the backends' modules while `run()` runs (a loop per token shows as lines per
    token; NumPy's and torch's own loops run in C and count nothing)."""
    import sys

    backends = str(StepBuffers.__module__).rsplit(".", 1)[0].replace(".", "/")
    count = 0

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        nonlocal count
        if backends in frame.f_code.co_filename:
            if event == "line":
                count += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        run()  # type: ignore[operator]
    finally:
        sys.settrace(None)
    return count


def test_staging_has_no_loop_per_token() -> None:
    """The Python work of staging a step does not grow with its tokens: two sequences' prompt chunks of 2 or of
    20 tokens run the same lines; per sequence it grows by a constant (the rows' book-keeping), in decode steps
    and chunk steps alike."""
    lines = {}
    for chunk in (2, 20):
        buf, entries = _steps(2, chunk)
        lines[chunk] = _lines_run(lambda b=buf, e=entries: b.inputs_of(b.write(e)))
    assert lines[2] == lines[20]
    decode = {}
    for n_seqs in (2, 4, 8):
        buf, entries = _steps(n_seqs, 1, decode=True)
        decode[n_seqs] = _lines_run(lambda b=buf, e=entries: b.write(e, rows_to=8))
    assert decode[8] - decode[4] == 2 * (decode[4] - decode[2])  # linear in the sequences
    assert (decode[4] - decode[2]) / 2 <= 16  # per sequence: place()'s loop body and the ids' comprehension
