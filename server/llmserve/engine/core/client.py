"""The engine core as its clients hold it: the `Core` interface, the commands a client sends it, and the books
both implementations keep of the requests they gave it (`ClientRequests`).

The front end (frontend/async_engine.AsyncEngine) holds a `Core` and nothing else of the engine. Two stand behind it,
as in vLLM v1's EngineCoreClient (InprocClient, MPClient):

- `ThreadCore` (core/engine_core.py): `EngineCore` stepping on a thread of this process; what
  `--engine-in-process` and the tests that reach into the core's books run.
- `ProcessCore` (core/process.py): the same `EngineCore` in an engine process of its own, over two pipes; what
  `python -m llmserve` runs, so that the front end's Python does not take the interpreter lock from the thread
  that feeds the device.

What the interface promises, either way: handles are numbered by the client, from 1, so `after` and `abort` need
no round trip; every request added ends with exactly one final output (outputs.ended: usage and timing included),
whether it finished, was aborted, failed, or the core died or stopped; every session query is answered, or fails
with EngineDead once the core has ended (never left pending); the waiting count is one formula (`ClientRequests`).

The commands: everything a thread other than the step thread asks of the core is one of them, queued in the core's
inbox and applied when the inbox is next drained, so the step thread alone touches the books (no lock). A session
query carries the future its typed answer comes back through. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from llmserve.engine.types.adapters import AdapterAnswer, AdapterOp
from llmserve.engine.types.kv_cache import KvEvent
from llmserve.engine.types.outputs import EngineOutput
from llmserve.engine.types.protocol import EngineStats, SessionInfo
from llmserve.engine.types.request import CoreFacts, GenerationRequest

if TYPE_CHECKING:
    from llmserve.engine.lora.adapters import LoraAdapter

T = TypeVar("T")
# Why a request ends, and a call fails, once its core has stopped (on a thread or in an engine process).
STOPPED = "the engine has stopped"


@dataclass(slots=True, frozen=True)
class Add:
    """Start serving `request` under `handle` (its constraint, if any, is compiled by the core)."""

    handle: int
    request: GenerationRequest
    arrival: float  # time.monotonic() when the front end gave it to the core
    # The handle of completion 0 of the same n > 1 request: this one is admitted once that one's prompt is
    # computed, and reuses its KV blocks (frontend/fanout.py).
    after: int | None = None


@dataclass(slots=True, frozen=True)
class Abort:
    """Stop the request `handle`; its final output says CANCELLED.

    With `keep_generated` the front end ended the request itself (a stop string in its text after that many
    generated tokens): tokens past those are dropped, so the session keeps exactly what the caller was sent,
    and the request finishes as STOP_SEQUENCE."""

    handle: int
    keep_generated: int | None = None


@dataclass(slots=True, frozen=True)
class GetSession:
    """What the core holds for a session: its SessionInfo, or None when it holds nothing."""

    session_id: str
    reply: Future[SessionInfo | None]


@dataclass(slots=True, frozen=True)
class DeleteSession:
    """Free what the core holds for a session; the reply says whether it held anything."""

    session_id: str
    reply: Future[bool]


@dataclass(slots=True, frozen=True)
class ManageAdapters:
    """An AdapterService call (types/adapters.AdapterOp); `adapter` is a load's adapter, read before on another thread
    (lora/serving.LoraServing.prepare), so that the step thread only changes the books (None for the others)."""

    op: AdapterOp
    adapter: LoraAdapter | None
    reply: Future[AdapterAnswer]


Command = Add | Abort | GetSession | DeleteSession | ManageAdapters
Emit = Callable[[list[EngineOutput]], None]


class Core(Protocol):
    """The engine core, wherever it runs. Any thread may add, abort, ask about sessions and read the counts and
    stats; `start` and `stop` block (call them off the event loop), once each, start first.

    `add` raises EngineDead once the core has stopped; `emit` (given to `start`) is called on a thread of the
    implementation's, once per pass of the step loop, with that pass's outputs in order."""

    @property
    def facts(self) -> CoreFacts: ...  # what requests are checked against (request.validate)

    @property
    def dead_reason(self) -> str | None: ...  # why the core cannot serve any more; None while it can

    @property
    def pid(self) -> int | None: ...  # the engine process's, when the core runs in one

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...  # added, not ended, not running

    def start(self, emit: Emit) -> None: ...

    def add(self, request: GenerationRequest, *, after: int | None = None) -> int: ...

    def abort(self, handle: int, keep_generated: int | None = None) -> None: ...

    def get_session(self, session_id: str) -> Future[SessionInfo | None]: ...

    def delete_session(self, session_id: str) -> Future[bool]: ...

    def stats(self) -> EngineStats: ...

    def manage_adapters(self, op: AdapterOp) -> Future[AdapterAnswer]: ...  # AdapterService: load, unload, list

    def take_kv_events(self) -> list[KvEvent]: ...  # the prefix cache's stored/removed blocks since the last call

    def stop(self) -> None: ...  # what still runs ends CANCELLED; returns once the core has ended


class ClientRequests(Generic[T]):
    """The requests a client gave its core and has not seen end, by handle (numbered here, from 1), each with what
    the client keeps of it. Both implementations count their waiting requests here, the one way: added and not
    ended, less those running."""

    def __init__(self) -> None:
        self._handles = itertools.count(1)
        self._live: dict[int, T] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def add(self, value: T) -> int:
        handle = next(self._handles)
        self._live[handle] = value
        return handle

    def get(self, handle: int) -> T | None:
        return self._live.get(handle)

    def discard(self, handle: int) -> None:
        self._live.pop(handle, None)

    def end(self, outputs: Iterable[EngineOutput]) -> None:
        """Forget the requests whose final output is among `outputs`."""
        for output in outputs:
            if output.finish_reason is not None:
                self._live.pop(output.handle, None)

    def take_all(self) -> dict[int, T]:
        """Every request still live, forgotten here (the core has ended)."""
        with self._lock:
            live, self._live = self._live, {}
        return live

    def waiting(self, running: int) -> int:
        return max(0, len(self._live) - running)

    def stats(self, stats: EngineStats) -> EngineStats:
        """The core's stats with the client's waiting count (requests on their way to the core included)."""
        return dataclasses.replace(stats, waiting=self.waiting(stats.running))
