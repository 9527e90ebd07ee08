"""The persistent input batch (backends/input_batch.py): the eager forward's inputs (the gathered and compiled-kernel
paths) equal those built from scratch from the plan, whatever joins, leaves, grows, or has its table replaced; and a
steady decode rewrites almost nothing. The varlen path's staging over the same rows: test_step_buffers.py."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from llmserve.engine.backends.input_batch import InputBatch
from llmserve.engine.sched.plan import SeqStep

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
