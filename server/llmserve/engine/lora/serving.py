"""The engine core's adapters: names, residency, pins and device slots together, on the step thread.

The core owns one `LoraServing` (when the config serves adapters). It
- reads the `--lora` adapters at start (a refusal stops the start) and those the load RPC names (`load`);
- holds a request's adapter from admission to its end (`acquire` / `release`): nothing a waiting or running
  request will need is unloaded to make room (registry.py). An adapter unloaded to make room is read again from
  its folder when a request names it (`acquire` reads it again, on the step thread: a few ms for SmolLM2 rank 16);
- gives each step's distinct adapters a device slot (slot_books.py) and writes into the plan the slot of every
  entry (`SeqStep.lora_slot`) and the copies the backend makes before the forward (`StepPlan.lora_writes`).

Residency ids are never reused, so a slot whose adapter left memory is just the least recently used one: nothing
reads it before the books hand it to another adapter, which is copied in first.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING

from llmserve.engine.config import EngineConfig
from llmserve.engine.lora.adapters import AdapterRefused, LoraAdapter, read_adapter
from llmserve.engine.lora.cache_keys import adapter_root
from llmserve.engine.lora.registry import AdapterRegistry, NotResident, Resident
from llmserve.engine.lora.slot_books import SlotBooks
from llmserve.engine.sched.plan import NO_ADAPTER, StepPlan
from llmserve.engine.sched.sequence import HeldAdapter, SeqStatus, Sequence
from llmserve.engine.types.adapters import (
    AdapterAnswer,
    AdapterExists,
    AdapterInfo,
    AdapterOp,
    AdaptersBusy,
    LoadAdapter,
    LoraLimits,
    UnknownAdapter,
    UnloadAdapter,
)
from llmserve.engine.types.model import ModelShape
from llmserve.engine.types.stats import LoraStats

if TYPE_CHECKING:
    from llmserve.engine.sched.scheduler import Scheduler

ResidentAdapter = Resident[LoraAdapter]  # an adapter in host memory, as a request holds it


class LoraOff(RuntimeError):
    """An AdapterService call to a core that serves no adapters."""

    def __init__(self) -> None:
        super().__init__("this server serves no LoRA adapters: start it with --enable-lora or --lora NAME=PATH")

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return type(self), ()


class LoraServing:
    """The registry of adapters (at most `--max-cpu-loras` in memory) and the books of the `--max-loras` slots."""

    def __init__(self, config: EngineConfig, shape: ModelShape) -> None:
        self.shape = shape
        self.limits = LoraLimits(config.max_loras, config.cpu_loras, config.max_lora_rank)
        self.registry: AdapterRegistry[LoraAdapter] = AdapterRegistry(config.cpu_loras)
        self.slots = SlotBooks(config.max_loras)
        self.requests: Counter[str] = Counter()  # requests admitted per adapter name, since start
        self.reads = 0  # adapters read from their folders (loads and re-reads)
        self._names: tuple[str, ...] = ()  # the registered names, replaced whole when they change (stats' read)
        self._sets: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # the last stats' running and waiting
        self._changed = time.time()
        for name, path in config.loras:
            self.load(name, path)

    @classmethod
    def of(cls, config: EngineConfig, shape: ModelShape) -> LoraServing | None:
        """The books when the config serves adapters (the --lora ones read now: a refusal stops the start)."""
        return cls(config, shape) if config.lora_enabled else None

    # -- for the engine core -----------------------------------------------------------------------

    def bind(self, seq: Sequence) -> str | None:
        """At admission: hold the request's adapter for its sequence and key its caches by it (the root of its
        prefix hash chain). Returns why it cannot be served (the name is gone, its files changed, no room in memory),
        or None."""
        name = seq.request.adapter
        if name is None:
            return None
        try:
            seq.lora = held = self.acquire(name)
        except (UnknownAdapter, AdaptersBusy, AdapterRefused) as exc:
            return str(exc)
        seq.prefix_root = adapter_root(seq.prefix_root, held.payload.digest)
        return None

    def unbind(self, seq: Sequence) -> None:
        """At the end of a request (every way it ends): let go of its adapter."""
        if seq.lora is not None:
            self.release(seq.lora)
            seq.lora = None

    def stats_of(self, scheduler: Scheduler) -> LoraStats:
        """The metrics' snapshot, read from any thread: the step thread's lists and maps are copied in one C call
        each (under the interpreter lock) before they are walked, so that a step changing them cannot break it."""
        running, live = list(scheduler.running), list(scheduler.live.values())
        waiting = [s.lora for s in live if s.status is SeqStatus.WAITING]
        return self.stats([s.lora for s in running], waiting)

    def read(self, path: str) -> LoraAdapter:
        """Read and check an adapter folder (AdapterNotFound / AdapterRefused name the file); touches no books, so
        it may run off the step thread."""
        adapter = read_adapter(Path(path), self.shape, self.limits.max_lora_rank)
        self.reads += 1
        return adapter

    def prepare(self, op: AdapterOp) -> LoraAdapter | None:
        """What `apply` needs done off the step thread: a LoadAdapter's files read (raises what `read` raises)."""
        return self.read(op.path) if isinstance(op, LoadAdapter) else None

    def apply(self, op: AdapterOp, adapter: LoraAdapter | None = None) -> AdapterAnswer:
        """An AdapterService call on the books (on the step thread): `adapter` is what `prepare` read. Raises
        AdapterExists, AdaptersBusy, UnknownAdapter (and what reading raises, when nothing was prepared)."""
        loaded, draining = None, 0
        if isinstance(op, LoadAdapter):
            loaded = self.load(op.name, op.path, adapter)
        elif isinstance(op, UnloadAdapter):
            draining = self.unload(op.name)
        return AdapterAnswer(tuple(self.infos()), self.limits, loaded, draining)

    def load(self, name: str, path: str, adapter: LoraAdapter | None = None) -> AdapterInfo:
        """Register `name` (read from `path` unless `adapter` was read already). Raises AdapterExists,
        AdaptersBusy, AdapterNotFound, AdapterRefused."""
        if name in self.registry:  # before reading: an existing name is refused whatever the folder holds
            raise AdapterExists(name)
        self.registry.load(name, path, adapter if adapter is not None else self.read(path))
        self._names = tuple(self.names())
        return self.info(name)

    def unload(self, name: str) -> int:
        """Forget `name`; returns how many requests still hold it (they finish on it). Raises UnknownAdapter."""
        resident = self.registry.resident_of(name)
        held = 0 if resident is None else resident.pins
        self.registry.unload(name)
        self._names = tuple(self.names())
        self.requests.pop(name, None)
        return held

    def acquire(self, name: str) -> ResidentAdapter:
        """Hold `name` for a request until `release`; read again if it was unloaded to make room. Raises
        UnknownAdapter, AdaptersBusy (no room to read it again), AdapterNotFound/AdapterRefused (its folder
        changed)."""
        try:
            held = self.registry.acquire(name)
        except NotResident as gone:
            self.registry.reload(name, self.read(gone.source))
            held = self.registry.acquire(name)
        self.requests[name] += 1
        return held

    def release(self, held: HeldAdapter) -> None:
        self.registry.release(held.adapter_id)

    def assign(self, plan: StepPlan, held: Seq[HeldAdapter | None]) -> None:
        """Give the plan's adapters their slots: `held[i]` is the adapter of plan.seqs[i] (None: base). Sets each
        entry's lora_slot and the plan's lora_writes. Raises TooManyAdapters past --max-loras (the scheduler's
        bound keeps a step within it)."""
        ids = {h.adapter_id: h for h in held if h is not None}
        if not ids:
            return
        assignment = self.slots.assign(ids)
        for entry, h in zip(plan.seqs, held, strict=True):
            entry.lora_slot = NO_ADAPTER if h is None else assignment.slot_of[h.adapter_id]
        plan.lora_writes = [(slot, ids[adapter_id].payload) for slot, adapter_id in assignment.writes]

    # -- what the list RPC, GetModelInfo and the metrics read ------------------------------------

    def stats(self, running: Iterable[HeldAdapter | None], waiting: Iterable[HeldAdapter | None]) -> LoraStats:
        """The metrics' snapshot, from the adapters of the running and of the waiting requests."""
        run = {h.name for h in running if h is not None and h.name is not None}
        wait = {h.name for h in waiting if h is not None and h.name is not None} - run
        sets = (tuple(sorted(run)), tuple(sorted(wait)))
        if sets != self._sets:
            self._sets, self._changed = sets, time.time()
        names, requests = self._names, dict(self.requests)  # the names as a whole, replaced by each change
        return LoraStats(
            self.limits.max_loras,
            sets[0],
            sets[1],
            self._changed,
            len(names),
            self.registry.num_resident,
            tuple((name, requests.get(name, 0)) for name in names),
            self.slots.num_writes,
            self.reads,
        )

    def names(self) -> list[str]:
        return [state.name for state in self.registry.states()]

    def info(self, name: str) -> AdapterInfo:
        return next(i for i in self.infos() if i.name == name)

    def infos(self) -> list[AdapterInfo]:
        out = []
        for state in self.registry.states():
            resident = self.registry.resident_of(state.name)
            adapter = None if resident is None else resident.payload
            out.append(
                AdapterInfo(
                    state.name,
                    state.source,
                    0 if adapter is None else adapter.rank,
                    () if adapter is None else tuple(sorted(adapter.target_modules)),
                    state.resident,
                    state.requests,
                    0 if adapter is None else adapter.nbytes,
                )
            )
        return out
