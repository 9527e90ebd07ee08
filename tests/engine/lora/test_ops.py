"""The batched LoRA ops against the plain per-row formula: every row gets its own adapter's delta and nothing else,
grouped (decode rows) and as segments (prompt chunks) alike, across fused linears, padded ranks and partial
targets; base rows are left bit for bit as they were."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from llmserve.engine.lora.adapters import LoraModule
from llmserve.engine.lora.ops import NO_ADAPTER, SEGMENT_ROWS, LoraRows, add_lora
from llmserve.engine.lora.weights import StackedProjection

FAN_IN = 24
OUTS = (16, 8, 8)  # a fused q/k/v-like linear
MAX_RANK = 4
NUM_SLOTS = 3


def _modules(seed: int, targets: tuple[bool, ...]) -> list[list[LoraModule | None]]:
    """Per slot, per projection: a module of rank 1..MAX_RANK (or None where the slot does not target it)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[LoraModule | None]] = []
    for slot in range(NUM_SLOTS):
        rank = 1 + (seed + slot) % MAX_RANK
        row: list[LoraModule | None] = []
        for i, fan_out in enumerate(OUTS):
            if not targets[(slot + i) % len(targets)]:
                row.append(None)
                continue
            a = torch.randn(rank, FAN_IN, generator=gen, dtype=torch.float64)
            b = torch.randn(fan_out, rank, generator=gen, dtype=torch.float64)
            row.append(LoraModule(a, b, 0.5 + slot))
        out.append(row)
    return out


def _reference(x: torch.Tensor, y: torch.Tensor, slots: list[int], modules: list[list[LoraModule | None]]) -> None:
    """The formula, row by row: y_r += scale * (x_r A^T) B^T for the row's slot, each projection in its columns."""
    for r, slot in enumerate(slots):
        if slot == NO_ADAPTER:
            continue
        c0 = 0
        for module, fan_out in zip(modules[slot], OUTS, strict=True):
            if module is not None:
                y[r, c0 : c0 + fan_out] += module.scale * ((x[r] @ module.a.t()) @ module.b.t())
            c0 += fan_out


def _stacked(modules: list[list[LoraModule | None]], outs: tuple[int, ...] = OUTS) -> StackedProjection:
    projection = StackedProjection.empty(NUM_SLOTS, MAX_RANK, FAN_IN, outs, torch.float64)
    for slot, row in enumerate(modules):
        projection.write(slot, row)
    return projection


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.sampled_from([NO_ADAPTER, 0, 1, 2]), st.sampled_from([1, 1, 2, 3, SEGMENT_ROWS, 40])),
        min_size=1,
        max_size=8,
    ),
    seed=st.integers(0, 1000),
    targets=st.sampled_from([(True,), (True, False), (False, True, True)]),
)
def test_every_row_gets_its_own_adapters_delta(runs: list[tuple[int, int]], seed: int, targets: tuple[bool]) -> None:
    slots = [slot for slot, n in runs for _ in range(n)]
    modules = _modules(seed, targets)
    projection = _stacked(modules)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), FAN_IN, generator=gen, dtype=torch.float64)
    y0 = torch.randn(len(slots), sum(OUTS), generator=gen, dtype=torch.float64)
    expected = y0.clone()
    _reference(x, expected, slots, modules)
    rows = LoraRows.of(slots, NUM_SLOTS)
    y = y0.clone()
    if rows is None:
        assert set(slots) == {NO_ADAPTER}
    else:
        add_lora(x, y, projection, rows)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    base = [r for r, s in enumerate(slots) if s == NO_ADAPTER]
    assert torch.equal(y[base], y0[base]), "a base row was touched"


def test_runs_become_segments_and_the_rest_is_grouped() -> None:
    slots = [0, 1, NO_ADAPTER, 1] + [2] * SEGMENT_ROWS + [NO_ADAPTER] * 3 + [0] * (SEGMENT_ROWS - 1)
    rows = LoraRows.of(slots, NUM_SLOTS)
    assert rows is not None and rows.present == {0, 1, 2} and rows.num_rows == len(slots)
    assert rows.segments == [(4, 4 + SEGMENT_ROWS, 2)]
    grouped = rows.grouped
    assert grouped is not None and (grouped.lo, grouped.hi) == (0, 2)
    assert grouped.longest == SEGMENT_ROWS - 1 + 1  # slot 0: the short run and the first row
    index = grouped.index.view(2, grouped.longest)
    keep = torch.zeros(2 * grouped.longest, dtype=torch.long)
    keep[grouped.real] = 1
    keep = keep.view(2, grouped.longest)
    assert torch.equal(grouped.index[grouped.real], grouped.dest) and grouped.back is None  # base rows: not all grouped
    assert sorted(index[0][keep[0] == 1].tolist()) == [0] + list(range(4 + SEGMENT_ROWS + 3, len(slots)))
    assert index[1][keep[1] == 1].tolist() == [1, 3]
    assert set(index[1][keep[1] == 0].tolist()) == {1}  # padding reads and writes a row of its own group


def test_no_adapter_rows_means_no_rows_and_bad_slots_are_refused() -> None:
    assert LoraRows.of([NO_ADAPTER] * 5, NUM_SLOTS) is None
    assert LoraRows.of([], NUM_SLOTS) is None
    for bad in ([3], [0, -2]):
        with pytest.raises(ValueError, match="outside"):
            LoraRows.of(bad, NUM_SLOTS)


def test_a_linear_no_adapter_of_the_step_targets_is_skipped() -> None:
    modules = _modules(0, (True,))
    modules[1] = [None, None, None]
    projection = _stacked(modules)
    assert projection.targeted == {0, 2}
    rows = LoraRows.of([1, 1, NO_ADAPTER], NUM_SLOTS)
    assert rows is not None
    y = torch.ones(3, sum(OUTS), dtype=torch.float64)
    add_lora(torch.full((3, FAN_IN), float("nan"), dtype=torch.float64), y, projection, rows)
    assert torch.equal(y, torch.ones_like(y))  # not even read


def test_a_non_finite_row_spoils_only_its_own_output() -> None:
    modules = _modules(3, (True,))
    projection = _stacked(modules)
    slots = [0, 0, 1, 0, 2, 2, 2]  # slot 0's group is the longest: the others pad
    x = torch.randn(len(slots), FAN_IN, dtype=torch.float64)
    x[2] = float("inf")
    rows = LoraRows.of(slots, NUM_SLOTS)
    assert rows is not None
    y = torch.zeros(len(slots), sum(OUTS), dtype=torch.float64)
    add_lora(x, y, projection, rows)
    assert not torch.isfinite(y[2]).all()
    assert torch.isfinite(y[[0, 1, 3, 4, 5, 6]]).all()


def test_a_slot_rewritten_serves_the_new_adapter_and_cleared_adds_nothing() -> None:
    first, second = _modules(1, (True,)), _modules(2, (True,))
    projection = _stacked(first)
    projection.write(1, second[1])
    x = torch.randn(4, FAN_IN, dtype=torch.float64)
    slots = [1, 0, 1, 2]
    rows = LoraRows.of(slots, NUM_SLOTS)
    assert rows is not None
    y, expected = torch.zeros(4, sum(OUTS), dtype=torch.float64), torch.zeros(4, sum(OUTS), dtype=torch.float64)
    add_lora(x, y, projection, rows)
    _reference(x, expected, slots, [first[0], second[1], first[2]])
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    projection.clear(1)
    y2 = torch.zeros(4, sum(OUTS), dtype=torch.float64)
    add_lora(x, y2, projection, rows)
    assert torch.equal(y2[[0, 2]], torch.zeros(2, sum(OUTS), dtype=torch.float64))
    with pytest.raises(ValueError, match="rank 5 does not fit a slot of rank 4"):
        projection.write(0, [LoraModule(torch.zeros(5, FAN_IN), torch.zeros(16, 5), 1.0), None, None])
