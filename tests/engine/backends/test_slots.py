"""The slot formula (backends/slots.py): the vectorized forms equal the per-position formula."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from llmserve.engine.backends.slots import position_slots, slot, table_slots


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
    assert position_slots(table, start, end, block_size).tolist() == expected
    assert [slot(table[p // block_size], p % block_size, block_size) for p in range(start, end)] == expected
    assert table_slots(torch.tensor(table), block_size, end).tolist()[start:] == expected
