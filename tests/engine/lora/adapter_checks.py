"""The LoRA books' invariants and queries, from outside, for the tests: the registry's residency (`check_registry`,
`resident`) and the device slots' two maps (`check_slots`), and `forget`, a slot freed as its adapter leaves memory
(the engine never frees one: residency ids are never reused, so a slot whose adapter left is just the least recently
used one, lora/serving.py). They read the books' private state: no product code needs them."""

from __future__ import annotations

from typing import Any, TypeVar

from llmserve.engine.lora.registry import AdapterRegistry, Resident
from llmserve.engine.lora.slot_books import SlotBooks

T = TypeVar("T")


def check_registry(registry: AdapterRegistry[Any]) -> None:
    """Verify the registry's invariants; raises ValueError."""
    if registry.num_resident > registry.max_cpu_loras:
        raise ValueError(f"{registry.num_resident} resident adapters, at most {registry.max_cpu_loras}")
    if set(registry._idle) & set(registry._held):
        raise ValueError("an adapter is both idle and held")
    if any(r.pins != 0 or r.name is None for r in registry._idle.values()):
        raise ValueError("an idle adapter is held, or unnamed")
    if any(r.pins <= 0 for r in registry._held.values()):
        raise ValueError("a held adapter has no pins")
    named = [reg.resident for reg in registry._names.values() if reg.resident is not None]
    if len({r.adapter_id for r in named}) != len(named):
        raise ValueError("two names share a resident adapter")
    for reg in registry._names.values():
        kept = reg.resident
        if kept is not None and (kept.name != reg.name or resident(registry, kept.adapter_id) is not kept):
            raise ValueError(f"registration {reg.name!r} disagrees with its resident adapter")
    unnamed = [r for r in registry._held.values() if r.name is None]
    if len(named) + len(unnamed) != registry.num_resident:
        raise ValueError("a resident adapter is neither registered nor draining")


def resident(registry: AdapterRegistry[T], adapter_id: int) -> Resident[T] | None:
    """The resident adapter of that id, idle or held; None when it left memory."""
    return registry._idle.get(adapter_id) or registry._held.get(adapter_id)


def check_slots(books: SlotBooks) -> None:
    """Verify that the two maps agree; raises ValueError."""
    held = {adapter_id: slot for slot, adapter_id in enumerate(books._holder) if adapter_id is not None}
    if held != dict(books._slot):
        raise ValueError(f"slot holders {held} disagree with the slot index {dict(books._slot)}")


def forget(books: SlotBooks, adapter_id: int) -> int | None:
    """The adapter left host memory: free its slot (returned; None if it had none)."""
    slot = books._slot.pop(adapter_id, None)
    if slot is not None:
        books._holder[slot] = None
    return slot
