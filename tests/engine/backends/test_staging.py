"""Host-side step inputs. The decode graphs' rows (backends/staging.py): each step's inputs equal those built
from scratch, whatever joins, leaves, grows, or has its table replaced; and a steady decode rewrites almost
nothing. A prompt chunk's slots (torch_paged.chunk_slots) equal the per-position formula."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from llmserve.engine.backends.staging import DecodeRows
from llmserve.engine.backends.torch_paged import chunk_slots
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


def _check(rows: DecodeRows, steps: list[SeqStep], padded: int) -> None:
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
    rows = DecodeRows(16, MAX_BLOCKS, BS, PAD_BLOCK, PAD_SLOT, pin=False)
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
        rows.stage(steps, padded)
        _check(rows, steps, padded)
        for seq in running:
            seq.start += 1


def test_a_steady_decode_writes_only_new_blocks() -> None:
    """64 sequences decoding 32 steps: one table entry per block a sequence grows into, not the whole tables
    every step (a fresh build would write 64 x 32 x their width)."""
    rows = DecodeRows(64, MAX_BLOCKS, BS, PAD_BLOCK, PAD_SLOT, pin=False)
    running = [_Seq(i, 40 + i % BS, list(range(i * 20, i * 20 + 11))) for i in range(64)]
    rows.stage([_step(s) for s in running], 64)
    first = rows.entries_written
    assert first == sum(s.start // BS + 1 for s in running)
    for _ in range(32):
        for seq in running:
            seq.start += 1
            while len(seq.table) <= seq.start // BS:
                seq.table.append(len(seq.table))
        steps = [_step(s) for s in running]
        rows.stage(steps, 64)
        _check(rows, steps, 64)
    assert rows.entries_written - first == 64 * 32 // BS
    # One leaves from the front: the last row moves into its gap, the others stay where they are.
    before = rows.perm[:64].tolist()
    running.pop(0)
    steps = [_step(s) for s in running]
    rows.stage(steps, 64)
    _check(rows, steps, 64)
    after = rows.perm[:63].tolist()
    assert after[:62] == before[1:63] and after[62] == before[0]


@given(
    st.sampled_from([1, 4, 16]),
    st.lists(st.integers(0, 10_000), min_size=1, max_size=40),
    st.data(),
)
def test_chunk_slots_equal_the_per_position_formula(block_size: int, table: list[int], data: st.DataObject) -> None:
    positions = len(table) * block_size
    start = data.draw(st.integers(0, positions - 1))
    end = data.draw(st.integers(start + 1, positions))
    expected = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    assert chunk_slots(table, start, end, block_size) == expected
