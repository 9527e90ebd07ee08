"""The load rule: the cost table, the acceptance estimate, and the choice of drafts per sequence."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmserve.engine.spec.policy import Acceptance, Candidate, CostTable, Policy, expected_extra

# SmolLM2-135M float32 on this project's 2-core CPU, 512 tokens of context (benchmarks/results/
# 2026-12-02-cpu-spec-phase1.md: spec_verify_cost.py, batches 1/4/32, k 0/1/2/4/8, median of 15 forwards each).
CPU = CostTable(
    (1, 4, 32),
    (0, 1, 2, 4, 8),
    ((25.0, 29.9, 28.4, 28.3, 31.5), (27.7, 42.1, 49.0, 53.8, 76.5), (72.1, 218.7, 268.4, 327.6, 491.6)),
)
FLAT = CostTable((1, 64), (0, 8), ((10.0, 10.0), (40.0, 40.0)))  # drafts cost nothing


def test_the_table_is_read_at_its_points_between_them_and_past_its_largest_batch() -> None:
    assert CPU.step_ms(4, 2) == 49.0
    assert CPU.step_ms(4, 3) == pytest.approx((49.0 + 53.8) / 2)
    assert CPU.step_ms(2.5, 0) == pytest.approx((25.0 + 27.7) / 2)
    assert CPU.step_ms(64, 1) == pytest.approx(218.7 * 2)
    assert CPU.step_ms(1, 12) == 31.5  # more drafts than measured: as the most measured
    assert CPU.step_ms(0, 4) == 0.0
    assert CPU.row(4) == [27.7, 42.1, 49.0, 53.8, 76.5]


def test_the_table_is_built_from_the_probes_rows_and_checked() -> None:
    rows = [{"batch": b, "k": k, "forward_ms": 10.0 * b + k} for b in (1, 8) for k in (0, 2)]
    assert CostTable.from_rows(rows) == CostTable((1, 8), (0, 2), ((10.0, 12.0), (80.0, 82.0)))
    with pytest.raises(ValueError, match="ks must be increasing and start at 0"):
        CostTable((1,), (1, 2), ((1.0, 2.0),))
    with pytest.raises(ValueError, match="batches must be increasing and >= 1"):
        CostTable((4, 1), (0,), ((1.0,), (1.0,)))
    with pytest.raises(ValueError, match="ms must have a row per batch and a column per k"):
        CostTable((1,), (0, 1), ((1.0,),))


def test_expected_extra_tokens() -> None:
    assert expected_extra(0.5, 0) == 0.0
    assert expected_extra(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_extra(1.0, 4) == 4.0


def test_acceptance_follows_the_request_and_drifts_back_without_drafts() -> None:
    estimate = Acceptance()
    assert estimate.rate == 0.5
    for _ in range(10):
        estimate.update(4, 4)  # every draft accepted
    assert estimate.rate > 0.9
    for _ in range(25):
        estimate.update(4, 0)  # the first draft rejected, again and again
    assert estimate.rate < 0.3
    low = estimate.rate
    for _ in range(60):
        estimate.update(0, 0)
    assert low < estimate.rate and estimate.rate == pytest.approx(0.5, abs=0.01)


def test_on_the_cpu_it_speculates_for_one_stream_and_is_off_at_32() -> None:
    policy = Policy(CPU)
    assert policy.choose([Candidate(8, 0.7)], budget=512)[0] >= 4
    assert policy.choose([Candidate(8, 0.7)] * 4, budget=512) == [4, 4, 4, 4]
    assert policy.choose([Candidate(8, 0.7)] * 32, budget=512) == [0] * 32
    assert policy.choose([Candidate(8, 0.05)], budget=512) == [0]  # drafts that are hardly ever right do not pay
    assert policy.choose([Candidate(8, 0.9)] * 32, budget=512) == [0] * 32
    assert policy.worthwhile(1, 0.5) and policy.worthwhile(4, 0.7) and not policy.worthwhile(4, 0.5)
    assert not policy.worthwhile(32, 0.9)
    assert policy.worthwhile(32, 1.0)  # 9 tokens for 6.8x the step: only perfect drafts would pay at 32


def test_the_confident_sequences_verify_and_the_others_do_not() -> None:
    cost = CostTable((4,), (0, 4), ((40.0, 60.0),))
    chosen = Policy(cost).choose([Candidate(4, 0.1), Candidate(4, 0.95), Candidate(0, 0.99), Candidate(4, 0.9)], 64)
    assert chosen == [0, 4, 0, 4]


def test_free_drafts_are_all_taken_within_the_budget() -> None:
    policy = Policy(FLAT)
    assert policy.choose([Candidate(8, 0.5), Candidate(3, 0.5)], budget=64) == [8, 3]
    assert sum(policy.choose([Candidate(8, 0.5)] * 4, budget=10)) <= 10
    assert policy.choose([Candidate(8, 0.5)], budget=0) == [0]
    assert policy.choose([], budget=8) == []


tables = st.builds(
    lambda base, slopes, per: CostTable(
        (1, 8, 32), (0, 2, 8), tuple((b, b + s * per, b + 4 * s * per) for b, s in zip(base, slopes, strict=True))
    ),
    base=st.tuples(st.floats(5, 30), st.floats(30, 60), st.floats(60, 120)).map(sorted),
    slopes=st.tuples(*[st.floats(0, 3)] * 3),
    per=st.floats(0.5, 20),
)


@given(
    cost=tables,
    candidates=st.lists(st.builds(Candidate, st.integers(0, 8), st.floats(0, 1)), max_size=40),
    budget=st.integers(0, 300),
)
def test_the_choice_never_lowers_the_modelled_rate_nor_exceeds_what_is_offered_or_the_budget(
    cost, candidates, budget
) -> None:
    policy = Policy(cost)
    chosen = policy.choose(candidates, budget)
    assert len(chosen) == len(candidates) and sum(chosen) <= max(0, budget)
    assert all(0 <= k <= c.offered for k, c in zip(chosen, candidates, strict=True))
    n = len(candidates)
    verifying = [k for k in chosen if k]
    if verifying:
        base = cost.step_ms(n, 0)
        extra = (cost.step_ms(n, sum(verifying) / len(verifying)) - base) * len(verifying) / n
        gain = sum(expected_extra(c.rate, k) for k, c in zip(chosen, candidates, strict=True))
        assert (n + gain) / (base + extra) >= policy.min_gain * n / base
