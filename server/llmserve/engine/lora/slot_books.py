"""The books of the device slots: which resident adapter each of the `max_loras` slots of the stacked LoRA weights
holds (weights.py keeps the tensors; these are the integers).

A step's rows may use at most `max_loras` distinct adapters (the scheduler admits no more). Before the step's
forward, `assign` gives each of them a slot: one that holds it already keeps it (nothing is copied: the common case
in a decode stretch), else a free slot, else the least recently used slot that no adapter of this step holds. The
slots whose adapter changed are returned, for the backend to copy the adapter's factors into before the forward.
An adapter that leaves host memory (registry.py) keeps its slot until the slot is reused: adapter ids are unique
per residency, so a slot never serves an adapter read again under an old id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


class TooManyAdapters(RuntimeError):
    """A step asked for more distinct adapters than there are slots: the scheduler's bound was not kept."""


@dataclass(slots=True)
class SlotAssignment:
    """One step's slots: `slot_of` each of its adapters, and the `writes` (slot, adapter id) to copy before the
    forward, in slot order."""

    slot_of: dict[int, int] = field(default_factory=dict)
    writes: list[tuple[int, int]] = field(default_factory=list)


class SlotBooks:
    """Adapter ids in `max_loras` device slots, least recently used slot reused first."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self._holder: list[int | None] = [None] * max_loras  # slot -> adapter id
        self._slot: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.num_writes = 0  # slots filled, all steps (for the tests and the metrics)

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot.get(adapter_id)

    def assign(self, adapter_ids: Iterable[int]) -> SlotAssignment:
        """Slots for a step's distinct adapters; raises TooManyAdapters when there are more than `max_loras`."""
        wanted = list(dict.fromkeys(adapter_ids))
        if len(wanted) > self.max_loras:
            raise TooManyAdapters(f"{len(wanted)} adapters in one step, --max-loras is {self.max_loras}")
        out = SlotAssignment()
        missing = []
        for adapter_id in wanted:
            slot = self._slot.get(adapter_id)
            if slot is None:
                missing.append(adapter_id)
            else:
                self._slot.move_to_end(adapter_id)
                out.slot_of[adapter_id] = slot
        if missing:
            free = [s for s, holder in enumerate(self._holder) if holder is None]
            free.reverse()  # the lowest free slot first
            for adapter_id in missing:
                if free:
                    slot = free.pop()
                else:  # the least recently used slot: never one of this step's (they were just moved to the end)
                    old, slot = self._slot.popitem(last=False)
                    if old in out.slot_of:
                        raise TooManyAdapters("no slot left that this step does not use")
                self._holder[slot] = adapter_id
                self._slot[adapter_id] = slot
                out.slot_of[adapter_id] = slot
                out.writes.append((slot, adapter_id))
            out.writes.sort()
            self.num_writes += len(missing)
        return out
