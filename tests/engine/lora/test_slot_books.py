"""The device slots' books on their own, then a state machine that drives the registry and the slot books together
as the engine will: requests hold adapters, steps take slots for the adapters they run, loads unload the least
recently used idle adapter and free its slot. A shadow of the stacked weights (which adapter each slot's tensors
hold, as the backend would have copied them) is checked after every step: each row's slot holds its own adapter."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmserve.engine.lora.registry import AdapterRegistry, NotResident
from llmserve.engine.lora.slot_books import SlotBooks, TooManyAdapters
from llmserve.engine.types.adapters import AdaptersBusy, UnknownAdapter
from tests.engine.lora.adapter_checks import check_registry, check_slots, forget, resident


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_loras must be >= 1"):
        SlotBooks(0)


def test_an_adapter_keeps_its_slot_and_nothing_is_copied_again() -> None:
    books = SlotBooks(2)
    first = books.assign([7, 8, 7])
    assert first.slot_of == {7: 0, 8: 1} and first.writes == [(0, 7), (1, 8)]
    again = books.assign([8])
    assert again.slot_of == {8: 1} and again.writes == []
    assert books.num_writes == 2
    check_slots(books)


def test_the_least_recently_used_slot_not_in_the_step_is_reused() -> None:
    books = SlotBooks(3)
    books.assign([1, 2, 3])
    books.assign([1])  # 2 is now the least recently used, then 3
    out = books.assign([3, 4])
    assert out.slot_of == {3: 2, 4: 1} and out.writes == [(1, 4)]
    assert books.slot_of(2) is None
    check_slots(books)


def test_forgotten_adapters_free_their_slot_lowest_first() -> None:
    books = SlotBooks(3)
    books.assign([1, 2, 3])
    assert forget(books, 3) == 2 and forget(books, 1) == 0 and forget(books, 99) is None
    assert books.assign([5, 6]).writes == [(0, 5), (2, 6)]
    check_slots(books)


def test_more_adapters_than_slots_in_one_step_is_refused() -> None:
    books = SlotBooks(2)
    books.assign([1])
    with pytest.raises(TooManyAdapters, match="3 adapters in one step, --max-loras is 2"):
        books.assign([2, 3, 4])
    assert books.slot_of(1) == 0 and books.slot_of(2) is None  # a refused step changes nothing
    check_slots(books)


def test_the_checker_catches_bad_books() -> None:
    books = SlotBooks(2)
    books.assign([1])
    books._holder[1] = 1  # planted: two slots claim adapter 1
    with pytest.raises(ValueError, match="disagree"):
        check_slots(books)


NAMES = ["a", "b", "c", "d", "e"]


class AdapterBooks(RuleBasedStateMachine):
    @initialize(max_cpu=st.integers(1, 4), max_loras=st.integers(1, 3))
    def setup(self, max_cpu: int, max_loras: int) -> None:
        self.registry = AdapterRegistry[str](max_cpu)
        self.slots = SlotBooks(max_loras)
        self.version = 0
        self.requests: list[tuple[int, str]] = []  # (adapter id, payload) each live request holds
        self.device: dict[int, str | None] = {s: None for s in range(max_loras)}  # slot -> payload copied there
        self.payload_of: dict[int, str] = {}  # adapter id -> payload, for every residency so far
        self.use_order: list[int] = []  # resident ids, least recently used first, by the shadow's account

    def _free(self, payloads: list[str]) -> None:
        """The owner's side of an unload: forget each freed adapter's slot."""
        for payload in payloads:
            adapter_id = next(i for i, p in self.payload_of.items() if p == payload)
            forget(self.slots, adapter_id)
            self.use_order.remove(adapter_id)

    def _idle_lru(self) -> list[int]:
        held = {i for i, _ in self.requests}
        return [i for i in self.use_order if i not in held and resident(self.registry, i) is not None]

    def _admit(self, name: str) -> None:
        """A load (a new name) or a reload (a registered one whose adapter was unloaded to make room)."""
        if self.registry.resident_of(name) is not None:
            assert name in self.registry
            assert self.registry.reload(name, "ignored") == []  # resident already: it keeps what it has
            return
        self.version += 1
        payload = f"{name}#{self.version}"
        full = self.registry.num_resident == self.registry.max_cpu_loras
        idle = self._idle_lru()
        try:
            if name in self.registry:
                freed = self.registry.reload(name, payload)
            else:
                freed = self.registry.load(name, f"/adapters/{name}", payload)
        except AdaptersBusy:
            assert full and not idle, "refused while an idle adapter could have made room"
            return
        assert freed == ([self.payload_of[idle[0]]] if full else []), "not the least recently used idle adapter"
        self._free(freed)
        resident = self.registry.resident_of(name)
        assert resident is not None and resident.payload == payload
        self.payload_of[resident.adapter_id] = payload
        self.use_order.append(resident.adapter_id)

    @rule(name=st.sampled_from(NAMES))
    def load(self, name: str) -> None:
        self._admit(name)

    @rule(name=st.sampled_from(NAMES))
    def start_request(self, name: str) -> None:
        try:
            resident = self.registry.acquire(name)
        except UnknownAdapter:
            assert name not in self.registry
            return
        except NotResident:
            self._admit(name)  # the front end reads the files again, then the request acquires
            if self.registry.resident_of(name) is None:
                return  # the reload was refused: every resident adapter is held
            resident = self.registry.acquire(name)
        self.requests.append((resident.adapter_id, resident.payload))
        self.use_order.remove(resident.adapter_id)
        self.use_order.append(resident.adapter_id)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        adapter_id, payload = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        freed = self.registry.release(adapter_id)
        if freed is not None:
            assert freed == payload
            self._free([freed])
        else:
            self.use_order.remove(adapter_id)
            self.use_order.append(adapter_id)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        if name not in self.registry:
            return
        freed = self.registry.unload(name)
        if freed is not None:
            self._free([freed])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A step runs some of the live requests (at most max_loras distinct adapters, as the scheduler admits)."""
        rows = data.draw(st.lists(st.sampled_from(self.requests), min_size=1, max_size=6))
        ids = list(dict.fromkeys(i for i, _ in rows))[: self.slots.max_loras]
        before = {a: self.slots.slot_of(a) for a in ids}
        out = self.slots.assign(ids)
        assert sorted(out.slot_of) == sorted(ids)
        assert len(set(out.slot_of.values())) == len(ids), "two adapters of one step share a slot"
        needed = sorted(a for a in ids if before[a] is None)
        assert sorted(a for _, a in out.writes) == needed, "a copy that was not needed, or one missing"
        for slot, adapter_id in out.writes:
            self.device[slot] = self.payload_of[adapter_id]
        for adapter_id in ids:
            assert resident(self.registry, adapter_id) is not None, "a step runs an adapter that left memory"
            assert self.device[out.slot_of[adapter_id]] == self.payload_of[adapter_id], "a row reads another's slot"

    @invariant()
    def books_agree(self) -> None:
        check_registry(self.registry)
        check_slots(self.slots)
        for adapter_id, _ in self.requests:
            assert resident(self.registry, adapter_id) is not None, "a held adapter was unloaded"
        assert self.registry.num_resident <= self.registry.max_cpu_loras
        assert len(self.registry._held) == len({i for i, _ in self.requests})


AdapterBooks.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAdapterBooks = AdapterBooks.TestCase
