"""The adapter registry's books: names, residency bounded by max_cpu_loras (least recently used unloaded first,
never one a request holds), pins, draining unloads. Examples first, then a state machine with the slot books."""

from __future__ import annotations

import pytest

from llmserve.engine.lora.registry import AdapterRegistry, AdapterState, NotResident
from llmserve.engine.types.adapters import AdapterExists, AdaptersBusy, UnknownAdapter
from tests.engine.lora.adapter_checks import check_registry, resident


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras must be >= 1"):
        AdapterRegistry[int](0)


def test_load_acquire_release_unload() -> None:
    reg = AdapterRegistry[str](2)
    assert reg.load("a", "/x/a", "A") == []
    held = reg.acquire("a")
    assert (held.name, held.payload, held.pins) == ("a", "A", 1)
    assert reg.states() == [AdapterState("a", "/x/a", True, 1)] and len(reg._held) == 1
    assert reg.release(held.adapter_id) is None  # still registered: stays resident, idle
    assert len(reg._held) == 0 and reg.num_resident == 1
    assert reg.unload("a") == "A"  # idle: freed at once
    assert "a" not in reg and reg.num_resident == 0
    check_registry(reg)


def test_the_least_recently_used_idle_adapter_makes_room_and_its_name_stays() -> None:
    reg = AdapterRegistry[str](2)
    reg.load("a", "/a", "A")
    reg.load("b", "/b", "B")
    reg.release(reg.acquire("a").adapter_id)  # a used after b: b is now the least recently used
    assert reg.load("c", "/c", "C") == ["B"]
    assert [s.name for s in reg.states() if s.resident] == ["a", "c"]
    with pytest.raises(NotResident, match="adapter 'b' is not in memory; reload it from /b") as info:
        reg.acquire("b")
    assert info.value.source == "/b"
    assert reg.reload("b", "B2") == ["A"]  # a is now the least recently used
    assert reg.acquire("b").payload == "B2"
    check_registry(reg)


def test_a_held_adapter_is_never_unloaded_to_make_room() -> None:
    reg = AdapterRegistry[str](2)
    reg.load("a", "/a", "A")
    reg.load("b", "/b", "B")
    a, b = reg.acquire("a"), reg.acquire("b")
    with pytest.raises(AdaptersBusy, match=r"all 2 adapters in memory \(--max-cpu-loras\) are in use"):
        reg.load("c", "/c", "C")
    assert "c" not in reg and reg.num_resident == 2  # a refused load changes nothing
    reg.release(a.adapter_id)
    assert reg.load("c", "/c", "C") == ["A"]
    assert resident(reg, b.adapter_id) is b
    check_registry(reg)


def test_reload_refused_while_all_are_held_and_a_resident_name_keeps_what_it_has() -> None:
    reg = AdapterRegistry[str](1)
    reg.load("a", "/a", "A")
    reg.load("b", "/b", "B")  # a unloaded to make room
    held = reg.acquire("b")
    with pytest.raises(AdaptersBusy):
        reg.reload("a", "A2")
    assert reg.reload("b", "B2") == []  # already resident: another request reloaded it first
    assert resident(reg, held.adapter_id) is not None and held.payload == "B"
    check_registry(reg)


def test_unloading_a_held_adapter_drains_it() -> None:
    reg = AdapterRegistry[str](2)
    reg.load("a", "/a", "A")
    first, second = reg.acquire("a"), reg.acquire("a")
    assert reg.unload("a") is None  # held: freed by the last release
    with pytest.raises(UnknownAdapter, match="no adapter named 'a' is loaded"):
        reg.acquire("a")
    assert reg.num_resident == 1  # still in memory, still counted
    reg.load("a", "/a2", "A2")  # the name is free again: a new residency, another id
    assert reg.acquire("a").adapter_id != first.adapter_id
    assert reg.release(first.adapter_id) is None
    assert reg.release(second.adapter_id) == "A"
    assert reg.num_resident == 1
    check_registry(reg)


def test_errors_name_the_adapter() -> None:
    reg = AdapterRegistry[str](1)
    reg.load("a", "/a", "A")
    with pytest.raises(AdapterExists, match="an adapter named 'a' is loaded already"):
        reg.load("a", "/other", "X")
    for call in (lambda: reg.unload("zz"), lambda: reg.reload("zz", "Z"), lambda: reg.acquire("zz")):
        with pytest.raises(UnknownAdapter) as info:
            call()
        assert info.value.name == "zz"
    with pytest.raises(ValueError, match="adapter id 99 is not held"):
        reg.release(99)
    reg.unload("a")
    assert len(reg) == 0


def test_the_checker_catches_bad_books() -> None:
    reg = AdapterRegistry[str](1)
    reg.load("a", "/a", "A")
    held = reg.acquire("a")
    held.pins = 0  # a planted miscount
    with pytest.raises(ValueError, match="a held adapter has no pins"):
        check_registry(reg)
