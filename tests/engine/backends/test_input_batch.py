"""The persistent input batch (backends/input_batch.py): each step's inputs, for the decode graphs and for the
eager forward alike, equal those built from scratch from the plan, whatever joins, leaves, grows, or has its
table replaced; and a steady decode rewrites almost nothing."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from llmserve.engine.backends.input_batch import InputBatch
from llmserve.engine.plan import SeqStep

BS = 4
MAX_BLOCKS = 32
PAD_BLOCK, PAD_SLOT = 99, 99 * BS


@dataclass
class _Seq:
    seq_no: int
    start: int
    table: list[int] = field(default_factory=list)


def _step(seq: _Seq) -> SeqStep:
    return SeqStep(seq, seq.start, [1000 + seq.seq_no * 7 + seq.start], seq.table, None)  # type: ignore[arg-type]


def _check(rows: InputBatch, steps: list[SeqStep], padded: int) -> None:
    n = len(steps)
    perm = rows.perm[:padded].tolist()
    assert sorted(perm[:n]) == list(range(n)) and perm[n:] == list(range(n, padded))
    for i, step in enumerate(steps):
        row = perm[i]
        need = step.start // BS + 1
        assert rows.tables[row, :need].tolist() == list(step.block_table[:need]), (i, row)
        assert rows.ids[row] == step.token_ids[0] and rows.positions[row] == step.start
        assert rows.slots[row] == step.block_table[step.start // BS] * BS + step.start % BS
        assert rows.lens[row] == step.start + 1
    for row in range(n, padded):
        assert rows.lens[row] == 1 and rows.slots[row] == PAD_SLOT and rows.tables[row, 0] == PAD_BLOCK
        assert rows.ids[row] == 0 and rows.positions[row] == 0


def test_rows_equal_a_fresh_build_through_joins_leaves_growth_and_replaced_tables() -> None:
    rng = random.Random(3)
    rows = InputBatch(16, MAX_BLOCKS, BS, PAD_BLOCK, PAD_SLOT, pin=False)
    next_block = iter(range(10**6))
    running: list[_Seq] = []
    seq_nos = iter(range(1, 10**6))
    for _ in range(400):
        # Leave (finished or preempted), join, grow by one token, and now and then a replaced table (preemption
        # and re-admission, or a copy-on-write at admission: a new list, maybe the same length).
        for seq in [s for s in running if rng.random() < 0.1]:
            running.remove(seq)
        while len(running) < 16 and rng.random() < 0.5:
            start = rng.randrange(0, 60)
            running.insert(rng.randrange(len(running) + 1), _Seq(next(seq_nos), start))
        for seq in running:
            if rng.random() < 0.05:
                seq.table = [next(next_block) % 90 for _ in seq.table]
            while len(seq.table) <= seq.start // BS:
                seq.table.append(next(next_block) % 90)
        if not running:
            continue
        if rng.random() < 0.1:
            rng.shuffle(running)  # the plan's order is the scheduler's; rows need not follow it
        steps = [_step(s) for s in running]
        padded = next(b for b in (1, 2, 4, 8, 16) if b >= len(steps))
        rows.stage_decode(steps, padded)
        _check(rows, steps, padded)
        for seq in running:
            seq.start += 1


def test_a_steady_decode_writes_only_new_blocks() -> None:
    """64 sequences decoding 32 steps: one table entry per block a sequence grows into, not the whole tables
    every step (a fresh build would write 64 x 32 x their width)."""
    rows = InputBatch(64, MAX_BLOCKS, BS, PAD_BLOCK, PAD_SLOT, pin=False)
    running = [_Seq(i, 40 + i % BS, list(range(i * 20, i * 20 + 11))) for i in range(64)]
    rows.stage_decode([_step(s) for s in running], 64)
    first = rows.entries_written
    assert first == sum(s.start // BS + 1 for s in running)
    for _ in range(32):
        for seq in running:
            seq.start += 1
            while len(seq.table) <= seq.start // BS:
                seq.table.append(len(seq.table))
        steps = [_step(s) for s in running]
        rows.stage_decode(steps, 64)
        _check(rows, steps, 64)
    assert rows.entries_written - first == 64 * 32 // BS
    # One leaves from the front: the last row moves into its gap, the others stay where they are.
    before = rows.perm[:64].tolist()
    running.pop(0)
    steps = [_step(s) for s in running]
    rows.stage_decode(steps, 64)
    _check(rows, steps, 64)
    after = rows.perm[:63].tolist()
    assert after[:62] == before[1:63] and after[62] == before[0]


# -- the eager forward's inputs (stage): mixed chunks and decodes --------------------------------------------


@dataclass
class _Live:
    seq_no: int
    length: int  # tokens in the sequence
    computed: int = 0
    table: list[int] = field(default_factory=list)


def _check_staged(rows: InputBatch, steps: list[SeqStep]) -> None:
    """The staged inputs equal what the plan says, built from scratch: the same as a fresh batch's, and each
    position's slot by the formula."""
    staged = rows.stage(steps)
    fresh = InputBatch(16, MAX_BLOCKS, BS, PAD_BLOCK, PAD_SLOT, pin=False).stage(steps)
    assert staged.ids.tolist() == fresh.ids.tolist()
    assert staged.positions.tolist() == fresh.positions.tolist()
    assert staged.slots.tolist() == fresh.slots.tolist()
    assert staged.lens.tolist() == fresh.lens.tolist() == [s.end for s in steps]
    assert staged.query_start.tolist() == fresh.query_start.tolist()
    assert staged.max_query_len == max(len(s.token_ids) for s in steps)
    positions = [p for s in steps for p in range(s.start, s.end)]
    slots = [s.block_table[p // BS] * BS + p % BS for s in steps for p in range(s.start, s.end)]
    assert staged.positions.tolist() == positions and staged.slots.tolist() == slots
    assert staged.ids.tolist() == [t for s in steps for t in s.token_ids]
    assert sorted(staged.rows.tolist()) == list(range(len(steps)))  # live rows are 0..n-1
    for i, step in enumerate(steps):
        width = int(staged.widths[i])
        assert width == (step.end - 1) // BS + 1
        got = rows.tables_of(staged.rows[i : i + 1], width)[0].tolist()
        assert got == list(step.block_table[:width]), (i, step.start)


def test_eager_inputs_equal_a_rebuild_from_the_plan_through_adds_finishes_and_preemptions() -> None:
    """A scheduler's life in miniature: sequences arrive with prompts, prefill in chunks, decode, finish, and are
    preempted (their table dropped) and re-admitted with a new table to recompute; every step's staged inputs
    equal a fresh build from that step's plan."""
    rng = random.Random(5)
    rows = InputBatch(16, MAX_BLOCKS, BS, PAD_BLOCK, PAD_SLOT, pin=False)
    free_blocks = list(range(90))
    rng.shuffle(free_blocks)
    live: list[_Live] = []
    seq_nos = iter(range(1, 10**6))
    preempted = finished = 0
    for _ in range(300):
        while len(live) < 16 and rng.random() < 0.3:
            live.append(_Live(next(seq_nos), rng.randint(1, 40)))
        for seq in [s for s in live if s.computed >= s.length]:
            live.remove(seq)  # finished
            free_blocks.extend(seq.table)
            finished += 1
        if live and rng.random() < 0.08:
            seq = rng.choice(live)  # preempted: blocks freed; re-admitted later with a new list
            free_blocks.extend(seq.table)
            seq.table, seq.computed = [], 0
            preempted += 1
        steps = []
        budget = 48
        for seq in live:
            n = min(seq.length - seq.computed, budget, rng.choice([1, 3, 8, 64]))
            if n <= 0:
                continue
            need = (seq.computed + n - 1) // BS + 1
            if need - len(seq.table) > len(free_blocks):
                continue
            if not seq.table:
                seq.table = []  # a new list, as the scheduler's admission makes
            while len(seq.table) < need:
                seq.table.append(free_blocks.pop())
            token_ids = [1000 + seq.seq_no * 7 + p for p in range(seq.computed, seq.computed + n)]
            steps.append(SeqStep(seq, seq.computed, token_ids, seq.table, None))  # type: ignore[arg-type]
            budget -= n
        if not steps:
            continue
        rng.shuffle(steps)
        steps.sort(key=lambda s: len(s.token_ids) != 1)  # the backends' packed order: decodes first
        _check_staged(rows, steps)
        for step in steps:
            step.seq.computed = step.end  # type: ignore[attr-defined]
    assert preempted > 5 and finished > 20


def test_a_steady_eager_decode_writes_only_new_blocks() -> None:
    """The eager paths keep the rows too: 16 sequences decoding 40 steps write one table entry per block they
    grow into after their first step."""
    rows = InputBatch(16, MAX_BLOCKS, BS, PAD_BLOCK, PAD_SLOT, pin=False)
    running = [_Seq(i, 30 + i, list(range(i * 20, i * 20 + (30 + i) // BS + 1))) for i in range(16)]
    rows.stage([_step(s) for s in running])
    first = rows.entries_written
    grown = 0
    for _ in range(40):
        for seq in running:
            seq.start += 1
            grown += seq.start % BS == 0
            while len(seq.table) <= seq.start // BS:
                seq.table.append(len(seq.table) + 500)
        _check_staged(rows, [_step(s) for s in running])
    assert rows.entries_written - first == grown
