"""benchmarks/loadgen.py, metrics.py and the plan's timing on hand-made records: windows, composition, percentiles,
decode per stream and the steady-window rule."""

from __future__ import annotations

import pytest

from benchmarks.loadgen import Measurement, RequestRecord, Schedule, compose_fifo
from benchmarks.metrics import STEADY_MIN_CALLS, decode_rate, percentile, steady, summarize, window_stats


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


def test_decode_rate_is_the_tokens_after_the_first_over_the_time_after_the_first() -> None:
    # A 100-ms first token (prefill) then 9 tokens 20 ms apart: 50 tokens/s once the answer has begun, whatever the
    # prefill cost; the whole call's 10 tokens over 0.28 s would say 35.7.
    assert decode_rate([0.1 + 0.02 * i for i in range(10)]) == pytest.approx(50.0)
    assert decode_rate([1.0, 1.0, 1.5]) == pytest.approx(4.0)  # two in the first message: both after-first count
    assert decode_rate([1.0]) is None and decode_rate([]) is None
    assert decode_rate([2.0, 2.0]) is None  # all at once: no time to divide by


def test_a_window_takes_the_median_decode_rate_of_calls_begun_and_finished_in_it() -> None:
    schedule = Schedule(concurrency=1, warmup_s=1.0, window_s=4.0, windows=1)
    records = [
        record("a", submit=1.0, first=1.5, gap=0.1, n=11),  # 10 tokens in 1.0 s after its first: 10/s
        record("b", submit=2.6, first=2.7, gap=0.05, n=11),  # 20/s
        record("c", submit=3.8, first=3.9, gap=0.025, n=5),  # 40/s
        record("early", submit=0.0, first=0.5, gap=0.01, n=101),  # first token in the warm-up: not counted
        RequestRecord("cut", 10, 4.8, [4.9, 4.95], None),  # cut off at the end: unfinished, not counted
        RequestRecord("failed", 10, 4.0, [4.1, 4.2], 4.2, error="RuntimeError: x"),
    ]
    shortened = record("short", submit=1.0, first=1.1, gap=0.001, n=3)
    shortened.warmup = True  # a client's shortened first call: its tokens count, its rate does not
    w = window_stats(Measurement(schedule, [*records, shortened], window_starts=[1.0]), 0)
    assert w.decode_samples == 3 and w.decode_per_stream_p50 == pytest.approx(20.0)
    empty = window_stats(Measurement(schedule, records[3:], window_starts=[1.0]), 0)
    assert empty.decode_samples == 0 and empty.decode_per_stream_p50 is None


def client_records(clients: int, first_end: list[float | None], inside: int) -> list[RequestRecord]:
    """Each client's opening call (ending at first_end[i], None: still running), then `inside` calls in 10..20."""
    out = []
    for i, end in enumerate(first_end):
        opening = RequestRecord(f"o{i}", 10, 0.0, [0.5], end, client=i)
        opening.warmup = i < clients - 1  # the closed loop shortens every first call but the last client's
        out.append(opening)
    for k in range(inside):
        out.append(record(f"w{k}", submit=10.0 + k * 0.1, first=10.5 + k * 0.1, gap=0.1, n=5))
        out[-1].client = k % clients
    return out


def test_a_window_is_steady_when_every_client_had_finished_a_call_and_enough_finished_in_it() -> None:
    schedule = Schedule(concurrency=4, warmup_s=10.0, window_s=10.0, windows=1)

    def window(first_end: list[float | None], inside: int) -> bool:
        m = Measurement(schedule, client_records(4, first_end, inside), window_starts=[10.0])
        return steady(window_stats(m, 0), 4)

    assert window([2.0, 4.0, 6.0, 9.9], STEADY_MIN_CALLS)
    # One client's opening call (its prompt's prefill, say) ran into the window: the start, not the steady state.
    assert not window([2.0, 4.0, 6.0, 10.5], STEADY_MIN_CALLS)
    assert not window([2.0, 4.0, 6.0, None], 20)
    assert not window([2.0, 4.0, 6.0, 9.0], STEADY_MIN_CALLS - 1)  # too few calls finished in it for a median
    m = Measurement(schedule, client_records(4, [2.0, 4.0, 6.0, 9.0], 5), window_starts=[10.0])
    stats = window_stats(m, 0)
    assert (stats.warm_clients, stats.completed) == (4, 5)
    # A failed opening call does not warm its client.
    m.records[0].error = "RuntimeError: x"
    assert window_stats(m, 0).warm_clients == 3


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
