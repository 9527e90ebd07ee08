"""Prompt lookup: the index proposes what a brute-force scan of the whole context proposes, call after call."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmserve.engine.spec.ngram import NgramConfig, NgramIndex, NgramProposer


def scan(tokens: list[int], config: NgramConfig, k: int) -> list[int]:
    """The definition: the longest suffix n-gram (n in [min_n, max_n]) that occurred before, and the up to k tokens
    after its latest (or earliest) earlier occurrence."""
    total = len(tokens)
    for n in range(min(config.max_n, total - 1), config.min_n - 1, -1):
        suffix = tokens[total - n :]
        ends = [e for e in range(n, total) if tokens[e - n : e] == suffix]
        if ends:
            end = max(ends) if config.latest else min(ends)
            return tokens[end : end + min(k, config.k)]
    return []


@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    cuts=st.lists(st.integers(1, 60), max_size=6),
    n=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    latest=st.booleans(),
    k=st.integers(1, 6),
)
def test_the_index_proposes_what_a_scan_of_the_context_proposes(tokens, cuts, n, latest, k) -> None:
    config = NgramConfig(n[0], n[0] + n[1], 5, latest=latest)
    index = NgramIndex(config)
    for cut in sorted(cuts) + [len(tokens)]:  # the sequence grows between calls
        prefix = tokens[:cut]
        assert index.propose(prefix, k) == scan(prefix, config, k)


def test_drafts_continue_the_latest_occurrence_of_the_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 7, 8, 1, 2, 3]
    assert NgramIndex(NgramConfig(2, 3, 4)).propose(tokens) == [7, 8, 1, 2]  # [1, 2, 3] last seen before 7
    assert NgramIndex(NgramConfig(2, 3, 4, latest=False)).propose(tokens) == [9, 1, 2, 4]
    assert NgramIndex(NgramConfig(2, 2, 4)).propose(tokens) == [7, 8, 1, 2]  # [2, 3]: its latest is before 7 too
    assert NgramIndex(NgramConfig(2, 3, 4)).propose([1, 2, 3, 4]) == []
    assert NgramIndex(NgramConfig(1, 3, 2)).propose([5, 6, 5]) == [6, 5]
    assert NgramIndex(NgramConfig(1, 3, 8)).propose(tokens, k=0) == []


def test_a_shorter_sequence_is_indexed_again() -> None:
    index = NgramIndex(NgramConfig(1, 2, 4))
    assert index.propose([1, 2, 3, 1]) == [2, 3, 1]
    assert index.propose([4, 5, 4]) == [5, 4]  # not the old [1, 2, 3]'s continuation


def test_the_proposer_keeps_one_index_per_sequence_until_released() -> None:
    proposer = NgramProposer(NgramConfig(1, 2, 3))
    assert proposer.propose(1, [7, 8, 7]) == [8, 7]
    assert proposer.propose(2, [5, 6, 5, 6, 5]) == [6, 5]
    assert len(proposer) == 2
    proposer.release(1)
    proposer.release(1)
    assert len(proposer) == 1


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="need 1 <= min_n <= max_n, got min_n=3, max_n=2"):
        NgramConfig(3, 2)
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        NgramConfig(1, 2, 0)
