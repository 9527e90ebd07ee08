"""benchmarks/alternation.py's turns: every system once a round, the order reversed every other round (alternate,
in_turn) or rotated one step a repetition (rotated_times), each system prepared for a client count before its windows
there, and the medians of what they measured, over the steady rounds where asked."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks import alternation
from benchmarks.alternation import alternate, in_turn, medians, point, rotated_times, steady_rounds
from benchmarks.loadgen import Measurement, RequestRecord, Schedule
from benchmarks.systems.base import System
from benchmarks.workload import BenchRequest


def test_systems_run_once_a_round_in_reversed_order_every_other_round(capsys: pytest.CaptureFixture[str]) -> None:
    order: list[str] = []

    def run(system: str) -> dict[str, Any]:
        order.append(system)
        return {"rate": float(len(order)), "peak": None}

    runs = in_turn(("a", "b", "c"), 3, run, {"part": "p"})
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert runs == {
        "a": [{"rate": 1.0, "peak": None}, {"rate": 6.0, "peak": None}, {"rate": 7.0, "peak": None}],
        "b": [{"rate": 2.0, "peak": None}, {"rate": 5.0, "peak": None}, {"rate": 8.0, "peak": None}],
        "c": [{"rate": 3.0, "peak": None}, {"rate": 4.0, "peak": None}, {"rate": 9.0, "peak": None}],
    }
    assert (
        capsys.readouterr().out.splitlines()[3] == "{'part': 'p', 'set': 1, 'system': 'c', 'rate': 4.0, 'peak': None}"
    )
    assert medians(runs, ["rate", "peak"]) == {
        "a": {"rate": 6.0, "peak": None},
        "b": {"rate": 5.0, "peak": None},
        "c": {"rate": 4.0, "peak": None},
    }


def test_variants_are_timed_once_a_repetition_in_rotated_order() -> None:
    order: list[str] = []
    variants = {name: (lambda name=name: order.append(name)) for name in ("x", "y", "z")}
    times = rotated_times(variants, 4)  # type: ignore[arg-type]
    assert order == ["x", "y", "z", "y", "z", "x", "z", "x", "y", "x", "y", "z"]
    assert {name: len(ts) for name, ts in times.items()} == {"x": 4, "y": 4, "z": 4}
    assert all(t >= 0 for ts in times.values() for t in ts)


class Recorded(System):
    """A system that records its `prepare` calls and runs, and serves nothing."""

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__(torch.device("cpu"))
        self.name, self.log = name, log

    async def prepare(self, clients: int) -> None:
        self.log.append(f"{self.name} prepare {clients}")

    async def run(self, requests: Iterator[BenchRequest], schedule: Schedule) -> Measurement:
        self.log.append(f"{self.name} {schedule.concurrency} {next(requests).request_id}")
        return Measurement(schedule, [], [0.0])


def test_alternate_prepares_each_system_for_a_client_count_before_its_windows_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(alternation, "ROOM_S", 0.0)
    log: list[str] = []
    chosen: dict[str, tuple[System, tuple]] = {n: (Recorded(n, log), ()) for n in ("a", "b")}
    args = argparse.Namespace(rounds=2, warmup_s=0.0, window_s=1.0)  # Recorded waits for nothing

    class Maker:
        def request(self, k: int) -> BenchRequest:
            return BenchRequest(f"r{k}", (1,), 1)

    out = asyncio.run(alternate(chosen, [1, 4], args, Maker()))  # type: ignore[arg-type]
    assert log == [
        "a prepare 1", "b prepare 1", "a 1 r0", "b 1 r0", "b 1 r10000", "a 1 r10000",
        "a prepare 4", "b prepare 4", "a 4 r20000", "b 4 r20000", "b 4 r30000", "a 4 r30000",
    ]  # fmt: skip
    assert {n: {c: len(ms) for c, ms in by.items()} for n, by in out.items()} == {n: {1: 2, 4: 2} for n in "ab"}


def window_run(rates: list[float], warm: bool) -> Measurement:
    """One closed-loop client's window over [10, 20): calls at `rates` tokens/s after the first (10 tokens each), and
    an opening call that ended before the window (`warm`) or in it."""
    schedule = Schedule(1, 10.0, 10.0)
    opening = RequestRecord("o", 10, 0.0, [1.0, 2.0], 9.0 if warm else 10.1, client=0)
    records, t = [opening], 10.2
    for k, rate in enumerate(rates):
        times = [t + i / rate for i in range(11)]
        records.append(RequestRecord(f"c{k}", 10, t - 0.1, times, times[-1], client=0))
        t = times[-1] + 0.1
    return Measurement(schedule, records, [10.0])


def test_a_round_counts_only_when_every_system_was_steady_and_only_counted_rounds_make_the_medians() -> None:
    ours = [window_run([20, 20, 20], True), window_run([40, 40, 40], True), window_run([99, 99, 99], True)]
    theirs = [window_run([10, 10, 10], True), window_run([10, 10, 10], False), window_run([10, 10], True)]
    flags = steady_rounds({"ours": ours, "theirs": theirs}, 1)
    assert flags == [True, False, False]  # round 2: theirs still in its opening call; round 3: 2 calls in theirs
    p = point(ours, flags)
    assert p["median_decode_per_stream"] == pytest.approx(20.0) and p["counted_windows"] == 1
    assert [r["counted"] for r in p["rounds"]] == flags and p["rounds"][1]["decode_per_stream"] == pytest.approx(40.0)
    assert p["median_output_tokens_per_s"] == pytest.approx(p["output_tokens_per_s"][0])
    assert point(ours)["median_decode_per_stream"] == pytest.approx(40.0)  # every window, where no flags are given
    none = point(theirs, [False, False, False])
    assert none["median_output_tokens_per_s"] is None and none["median_decode_per_stream"] is None
