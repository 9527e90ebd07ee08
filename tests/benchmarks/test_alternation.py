"""benchmarks/alternation.py's turns: every system once a round, the order reversed every other round (in_turn) or
rotated one step a repetition (rotated_times), and the medians of what they measured."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.alternation import in_turn, medians, rotated_times


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
