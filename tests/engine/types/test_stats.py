"""engine/types/stats.py: the one latency histogram type (history stores, KV tier reloads)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmserve.engine.types.stats import LatencyHistogram

BOUNDS = (0.001, 0.01, 0.1, 1.0)


@given(st.lists(st.floats(min_value=0.0, max_value=10.0, allow_nan=False), max_size=50))
def test_every_observation_lands_in_the_first_bucket_at_or_above_it(values: list[float]) -> None:
    h = LatencyHistogram(BOUNDS)
    for v in values:
        h.observe(v)
    assert h.count == len(values) == sum(h.counts) and h.total_s == pytest.approx(sum(values))
    rows = h.cumulative()
    assert [bound for bound, _ in rows] == ["0.001", "0.01", "0.1", "1.0", "+Inf"]
    for (bound, at_or_below), limit in zip(rows, (*BOUNDS, float("inf")), strict=True):
        assert at_or_below == sum(1 for v in values if v <= limit), bound


def test_a_bound_itself_counts_in_its_bucket_and_a_snapshot_does_not_move() -> None:
    h = LatencyHistogram(BOUNDS)
    h.observe(0.01)
    copy = h.snapshot()
    h.observe(5.0)
    assert copy.counts == [0, 1, 0, 0, 0] and copy.count == 1
    assert h.counts == [0, 1, 0, 0, 1] and h.cumulative()[-1] == ("+Inf", 2)


def test_bounds_must_ascend() -> None:
    with pytest.raises(ValueError, match="ascending"):
        LatencyHistogram((0.1, 0.01))
