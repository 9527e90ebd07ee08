"""benchmarks/window.py: a window counts the tokens that arrived inside it, time to first token for requests begun
inside it, decode rates for finished requests whose first message came inside it; spread token counts; the summary."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from benchmarks.window import Window, spread, ttft_summary, window_ratios


def test_a_window_counts_only_what_arrived_inside_it() -> None:
    window = Window(counted_from=10.0, end=20.0)
    window.open = 3
    window.done(5.0, [(9.0, 1), (11.0, 2), (19.5, 4), (20.0, 8)])  # began in the warm-up, ran past the end
    window.done(12.0, [(13.0, 1), (14.0, 3), (15.0, 3)])  # all inside
    window.done(18.0, [(19.0, 1), (19.9, 5)], finished=False)  # cut off at the end
    assert window.tokens == 2 + 4 + 1 + 3 + 3 + 1 + 5 and window.tokens_per_s == window.tokens / 10
    assert window.ttfts == [pytest.approx(1.0), pytest.approx(1.0)]  # the two begun inside
    assert window.decode_rates == [pytest.approx(6 / 2)]  # finished, first message inside: 6 tokens after it in 2 s
    assert window.open == 0
    window.open = 1
    window.done(15.0, [])  # a request that got nothing
    assert window.ttfts == [pytest.approx(1.0), pytest.approx(1.0)] and window.open == 0


def test_token_counts_not_known_per_message_are_spread_evenly() -> None:
    assert spread([1.0, 2.0, 3.0, 4.0], 10) == [(1.0, 2.5), (2.0, 2.5), (3.0, 2.5), (4.0, 2.5)]
    assert spread([], 5) == []


def test_the_ttft_summary() -> None:
    assert ttft_summary([]) == {"p50": None, "p99": None, "n": 0}
    assert ttft_summary([0.1, 0.2, 0.3]) == {"p50": 0.2, "p99": pytest.approx(0.298), "n": 3}


def test_ratios_of_windows_leave_out_a_base_that_got_nothing() -> None:
    assert window_ratios([2.0, 3.0, 1.0], [1.0, 2.0, 1.0]) == ([2.0, 1.5, 1.0], 1.5)
    assert window_ratios([1.7], [0.0]) == ([None], None)  # a smoke run's empty window: no ratio, no crash


def test_a_clients_calls_take_the_items_in_turn_from_its_own_until_the_window_is_over() -> None:
    window = Window.starting_now(0.0, 3600.0)
    calls = window.calls(2, ["a", "b", "c"])
    assert [next(calls) for _ in range(4)] == [(1, "c"), (2, "a"), (3, "b"), (4, "c")]
    window.end = window.counted_from  # over
    assert list(calls) == []


def test_a_counted_stream_begins_when_read_and_counts_each_responses_tokens() -> None:
    @dataclass
    class Response:
        token_ids: list[int]

    async def stream() -> AsyncIterator[Response]:
        for ids in ([1, 2], [], [3]):
            yield Response(ids)

    window = Window.starting_now(0.0, 3600.0)
    asyncio.run(window.count(stream()))
    assert window.tokens == 3 and window.open == 0 and len(window.ttfts) == 1
