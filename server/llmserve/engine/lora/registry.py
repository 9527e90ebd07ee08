"""The adapter registry: which adapters the server knows by name, and which of them are resident in host memory.

Book-keeping only (no tensors, no files): the payload of a resident adapter is whatever the owner keeps for it
(adapters.LoraAdapter in the engine, an integer in the tests). Names outlive residency, as vLLM's LoRA cache does:
- a name is *registered* by a load (`--lora NAME=PATH` at start, or the load RPC) and stays so until it is
  unloaded (the unload RPC);
- at most `max_cpu_loras` adapters are *resident* (their factors in host memory). Making room unloads the least
  recently used resident adapter that no request holds; its name stays registered, and the next request for it
  reads its files again (`NotResident`, then `reload`). When every resident adapter is held, a load or reload is
  refused (`AdaptersBusy`): nothing a running request uses is ever unloaded;
- a request holds its adapter from admission to its end (`acquire` / `release`: pin counts). Unloading a held
  adapter takes its name away at once (new requests get UnknownAdapter) and frees it when the last holder lets go
  (it is *draining* until then, and still counts as resident).

Each residency gets a fresh `adapter_id`, so that the device slots (slot_books.py) and the caches never mistake an
adapter read again, maybe from changed files, for the one that was there before.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from llmserve.engine.types.adapters import AdapterExists, AdaptersBusy, UnknownAdapter

T = TypeVar("T")


class NotResident(LookupError):
    """`name` is registered, but its factors were unloaded to make room: read `source` again and `reload`."""

    def __init__(self, name: str, source: str) -> None:
        super().__init__(f"adapter {name!r} is not in memory; reload it from {source}")
        self.name = name
        self.source = source


@dataclass(slots=True, eq=False)
class Resident(Generic[T]):
    """An adapter whose payload is in memory; `pins` requests hold it. `name` is None once unloaded (draining)."""

    adapter_id: int
    name: str | None
    payload: T
    pins: int = 0


@dataclass(slots=True)
class Registration(Generic[T]):
    """A name the server knows: where its adapter is read from, and its residency (None: unloaded to make room)."""

    name: str
    source: str
    resident: Resident[T] | None


@dataclass(slots=True, frozen=True)
class AdapterState:
    """One registered adapter as the list RPC and the metrics see it."""

    name: str
    source: str
    resident: bool
    requests: int  # requests that hold it now


class AdapterRegistry(Generic[T]):
    """Registered names, and at most `max_cpu_loras` resident adapters, least recently used unloaded first."""

    def __init__(self, max_cpu_loras: int) -> None:
        if max_cpu_loras < 1:
            raise ValueError("max_cpu_loras must be >= 1")
        self.max_cpu_loras = max_cpu_loras
        self._names: dict[str, Registration[T]] = {}
        # Resident adapters nobody holds, least recently used first: the ones room is made from.
        self._idle: OrderedDict[int, Resident[T]] = OrderedDict()
        self._held: dict[int, Resident[T]] = {}  # resident adapters with pins > 0 (draining ones too)
        self._next_id = 0

    # -- queries ---------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __len__(self) -> int:
        """Registered names."""
        return len(self._names)

    @property
    def num_resident(self) -> int:
        return len(self._idle) + len(self._held)

    def states(self) -> list[AdapterState]:
        """Every registered adapter, by name."""
        return [
            AdapterState(r.name, r.source, r.resident is not None, 0 if r.resident is None else r.resident.pins)
            for r in sorted(self._names.values(), key=lambda r: r.name)
        ]

    def resident_of(self, name: str) -> Resident[T] | None:
        """The resident adapter registered under `name` (None: unknown, or unloaded to make room); its LRU
        position is left as it is."""
        registration = self._names.get(name)
        return None if registration is None else registration.resident

    # -- changes ---------------------------------------------------------------------------------

    def load(self, name: str, source: str, payload: T) -> list[T]:
        """Register `name` with its adapter (read from `source`) resident. Returns the payloads unloaded to make
        room (the owner frees them). Raises AdapterExists, or AdaptersBusy (then nothing changed)."""
        if name in self._names:
            raise AdapterExists(name)
        evicted = self._make_room(name)
        self._names[name] = Registration(name, source, self._admit(name, payload))
        return evicted

    def reload(self, name: str, payload: T) -> list[T]:
        """Make a registered, unloaded adapter resident again (its files read anew). Returns the payloads unloaded
        to make room. A name that is resident already keeps what it has (another request reloaded it first).
        Raises UnknownAdapter, or AdaptersBusy (then nothing changed)."""
        registration = self._names.get(name)
        if registration is None:
            raise UnknownAdapter(name)
        if registration.resident is not None:
            return []
        evicted = self._make_room(name)
        registration.resident = self._admit(name, payload)
        return evicted

    def acquire(self, name: str) -> Resident[T]:
        """Hold `name`'s resident adapter for a request (until `release`); it becomes the most recently used.
        Raises UnknownAdapter, or NotResident (reload it, then acquire again)."""
        registration = self._names.get(name)
        if registration is None:
            raise UnknownAdapter(name)
        resident = registration.resident
        if resident is None:
            raise NotResident(name, registration.source)
        if resident.pins == 0:
            del self._idle[resident.adapter_id]
            self._held[resident.adapter_id] = resident
        resident.pins += 1
        return resident

    def release(self, adapter_id: int) -> T | None:
        """A request is done with the adapter. Returns its payload when that frees it (it was unloaded while
        held); else None. Raises ValueError for an adapter no request holds."""
        resident = self._held.get(adapter_id)
        if resident is None:
            raise ValueError(f"adapter id {adapter_id} is not held")
        resident.pins -= 1
        if resident.pins > 0:
            return None
        del self._held[adapter_id]
        if resident.name is None:
            return resident.payload
        self._idle[adapter_id] = resident  # most recently used
        return None

    def unload(self, name: str) -> T | None:
        """Forget `name`. Returns the payload freed now; None when it was not resident, or when requests still hold
        it (it is freed by the last `release`). Raises UnknownAdapter."""
        registration = self._names.pop(name, None)
        if registration is None:
            raise UnknownAdapter(name)
        resident = registration.resident
        if resident is None:
            return None
        resident.name = None
        if resident.pins > 0:
            return None
        del self._idle[resident.adapter_id]
        return resident.payload

    # -- helpers ---------------------------------------------------------------------------------

    def _make_room(self, name: str) -> list[T]:
        """Unload idle adapters, least recently used first, until one more fits; AdaptersBusy if none can go."""
        excess = self.num_resident + 1 - self.max_cpu_loras
        if excess > len(self._idle):
            raise AdaptersBusy(name, self.max_cpu_loras)
        evicted = []
        for _ in range(max(0, excess)):
            _, resident = self._idle.popitem(last=False)
            if resident.name is not None:  # always: an idle adapter that was unloaded was freed at once
                self._names[resident.name].resident = None
            evicted.append(resident.payload)
        return evicted

    def _admit(self, name: str, payload: T) -> Resident[T]:
        resident = Resident(self._next_id, name, payload)
        self._next_id += 1
        self._idle[resident.adapter_id] = resident
        return resident
