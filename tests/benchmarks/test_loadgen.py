"""benchmarks/loadgen.py, metrics.py and the plan's timing on hand-made records: windows, composition, percentiles."""

from __future__ import annotations

import pytest

from benchmarks.loadgen import Measurement, RequestRecord, Schedule, compose_fifo
from benchmarks.metrics import percentile, summarize, window_stats


def record(rid: str, submit: float, first: float, gap: float, n: int, group: int | None = None) -> RequestRecord:
    times = [first + i * gap for i in range(n)]
    return RequestRecord(rid, 10, submit, times, times[-1], group=group, started=submit if group is not None else None)


def test_percentile_interpolates_and_handles_empty() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_window_counts_only_what_happened_inside_it() -> None:
    schedule = Schedule(concurrency=2, warmup_s=1.0, window_s=2.0, windows=2)
    records = [
        record("warm", submit=0.0, first=0.5, gap=0.5, n=4),  # tokens 0.5..2.0; ends at 2.0 in window 0
        record("a", submit=1.0, first=1.5, gap=0.5, n=4),  # submitted at warm-up end: TTFT counts
        record("b", submit=3.2, first=3.5, gap=0.25, n=2),  # window 1
    ]
    m = Measurement(schedule, records, window_starts=[1.0, 3.0])
    w0, w1 = window_stats(m, 0), window_stats(m, 1)
    assert w0.output_tokens_per_s == pytest.approx(6 / 2.0)  # warm: 1.0, 1.5, 2.0; a: 1.5, 2.0, 2.5
    assert w1.output_tokens_per_s == pytest.approx(3 / 2.0)  # a: 3.0; b: 3.5, 3.75
    assert w0.requests_per_s == pytest.approx((3 / 4 + 3 / 4) / 2.0)  # requests' worth of tokens
    assert w0.completed == 1 and w0.e2e_p50_s == pytest.approx(2.0)
    assert w0.ttft_samples == 1 and w0.ttft_p50_s == pytest.approx(0.5)
    assert w1.completed == 2 and w1.ttft_samples == 1 and w1.ttft_p50_s == pytest.approx(0.3)
    assert w1.itl_p50_s is not None
    s = summarize("x", m)
    assert s.spread["output_tokens_per_s"] == pytest.approx(abs(w0.output_tokens_per_s - w1.output_tokens_per_s))


def test_window_records_the_work_it_served() -> None:
    schedule = Schedule(concurrency=2, warmup_s=1.0, window_s=2.0, windows=2)
    a = record("a", submit=0.0, first=0.5, gap=1.0, n=3)  # prompt 10; tokens 0.5, 1.5, 2.5
    b = RequestRecord("b", 40, 1.0, [1.2, 3.5], 3.5, cached_prompt_tokens=30)  # 10 new + 30 cached
    m = Measurement(schedule, [a, b], window_starts=[1.0, 3.0])
    w0, w1 = window_stats(m, 0), window_stats(m, 1)
    # Window 0: a's tokens 1 and 2 (contexts 11, 12), b's first (40); b's prompt began there, a's before.
    assert w0.prefills == [(10, 30)]
    assert w0.decode_context_mean == pytest.approx((11 + 12 + 40) / 3)
    assert w0.window_s == 2.0
    assert w1.prefills == [] and w1.decode_context_mean == pytest.approx(41)


def test_compose_fifo_adds_the_wait_for_the_groups_ahead() -> None:
    schedule = Schedule(concurrency=1, warmup_s=0.0, window_s=10.0, windows=1)
    # Three back-to-back requests of 1 s, 2 s, 3 s service on a single worker.
    records = [record("0", 0.0, 0.1, 0.1, 10, group=0), record("1", 1.0, 1.1, 0.1, 10, group=1)]
    records.append(record("2", 2.0, 2.1, 0.1, 10, group=2))
    for r, end in zip(records, (1.0, 2.0, 3.0), strict=True):
        r.end = end
    m = Measurement(schedule, records, window_starts=[0.0])
    composed = compose_fifo(m, concurrency=3, group_size=1)
    waits = {r.request_id: r.composed_wait for r in composed.records}
    # Each waits for the two groups before it, cyclically over the measured ones (all of 1 s here).
    assert waits == {"0": pytest.approx(2.0), "1": pytest.approx(2.0), "2": pytest.approx(2.0)}
    assert composed.schedule.concurrency == 3 and composed.composed_from == 1
    assert compose_fifo(m, concurrency=1, group_size=1).records[0].composed_wait == 0.0
    with pytest.raises(ValueError):
        compose_fifo(m, concurrency=3, group_size=2)


def test_baselines_get_their_own_main_timing_and_it_survives_json() -> None:
    from benchmarks.runner import BASE_WARMUP_S, schedules_for
    from benchmarks.settings import FULL_PLAN, BenchSettings

    settings = BenchSettings(plan=FULL_PLAN)
    base = FULL_PLAN.baseline_main
    assert base is not None and base.total_s < FULL_PLAN.main.total_s
    assert schedules_for("llmserve", None, settings)[0] == FULL_PLAN.main
    assert schedules_for("hf_continuous", None, settings)[0] == base
    # A single worker spends the baselines' main time on windows after a short warm-up, at its batch size.
    single = schedules_for("dynamic", 8, settings)[-1]
    assert (single.concurrency, single.warmup_s) == (8, BASE_WARMUP_S)
    assert single.total_s == base.total_s
    assert BenchSettings.from_json(settings.to_json()) == settings
