"""The engine core as the front end holds it: the `Core` interface, the books both of its implementations keep
(`InFlight`), and the first implementation, the core on a thread of this process (`ThreadCore`).

The front end (async_engine.AsyncEngine) holds a `Core` and nothing else of the engine. Two stand behind it, as in
vLLM v1's EngineCoreClient (InprocClient, MPClient):

- `ThreadCore` (here): `EngineCore` (core.py) stepping on a thread of this process; what `--engine-in-process` and
  the tests that reach into the core's books run.
- `ProcessCore` (core_process.py): the same `EngineCore` in an engine process of its own (core_child.py), over two
  pipes; what `python -m llmserve` runs, so that the front end's Python does not take the interpreter lock from the
  thread that feeds the device.

What the interface promises, either way: handles are numbered by the client, from 1, so `after` and `abort` need
no round trip; every request added ends with exactly one final output (outputs.ended: usage and timing included),
whether it finished, was aborted, failed, or the core died or stopped; every session query is answered, or fails
with EngineDead once the core has ended (never left pending); the waiting count is one formula (`InFlight`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from llmserve.engine.commands import Emit
from llmserve.engine.errors import EngineDead
from llmserve.engine.facts import CoreFacts
from llmserve.engine.kv_events import KvEvent
from llmserve.engine.lora.catalog import AdapterAnswer, AdapterOp
from llmserve.engine.outputs import EngineOutput
from llmserve.engine.protocol import EngineStats, SessionInfo
from llmserve.engine.request import GenerationRequest

if TYPE_CHECKING:  # the server's process imports this before torch (core_process.py); ThreadCore is given a core
    from llmserve.engine.core import EngineCore

T = TypeVar("T")


class Core(Protocol):
    """The engine core, wherever it runs. Any thread may add, abort, ask about sessions and read the counts and
    stats; `start` and `stop` block (call them off the event loop), once each, start first.

    `add` raises EngineDead once the core has stopped; `emit` (given to `start`) is called on a thread of the
    implementation's, once per pass of the step loop, with that pass's outputs in order."""

    @property
    def facts(self) -> CoreFacts: ...  # what requests are checked against (facts.validate)

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


class InFlight(Generic[T]):
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


class ThreadCore:
    """The `Core` on a thread of this process: `EngineCore` stepping on the thread `start` starts (after warming up on
    the caller's). `engine_core` is the core itself, for the tests and probes that reach into its books."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self._requests: InFlight[str] = InFlight()  # handle -> request id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def facts(self) -> CoreFacts:
        return self.engine_core.facts

    @property
    def dead_reason(self) -> str | None:
        return self.engine_core.dead_reason

    @property
    def pid(self) -> int | None:
        return None

    @property
    def num_running(self) -> int:
        return self.engine_core.num_running

    @property
    def num_waiting(self) -> int:
        return self._requests.waiting(self.engine_core.num_running)

    def start(self, emit: Emit) -> None:
        """Warm up (one short generation, on this thread), then start the step thread."""
        self.engine_core.warm_up()

        def counted(outputs: list[EngineOutput]) -> None:
            self._requests.end(outputs)
            emit(outputs)

        self._thread = threading.Thread(
            target=self.engine_core.run, args=(self._stop, counted), name="llmserve-engine", daemon=True
        )
        self._thread.start()

    def add(self, request: GenerationRequest, *, after: int | None = None) -> int:
        handle = self._requests.add(request.request_id)
        try:
            self.engine_core.submit(request, after=after, handle=handle)
        except EngineDead:
            self._requests.discard(handle)
            raise
        return handle

    def abort(self, handle: int, keep_generated: int | None = None) -> None:
        self.engine_core.abort(handle, keep_generated)

    def get_session(self, session_id: str) -> Future[SessionInfo | None]:
        return self.engine_core.get_session(session_id)

    def delete_session(self, session_id: str) -> Future[bool]:
        return self.engine_core.delete_session(session_id)

    def manage_adapters(self, op: AdapterOp) -> Future[AdapterAnswer]:
        return self.engine_core.manage_adapters(op)

    def stats(self) -> EngineStats:
        return self._requests.stats(self.engine_core.stats())

    def take_kv_events(self) -> list[KvEvent]:
        return self.engine_core.take_kv_events()

    def stop(self) -> None:
        """End the step loop (see EngineCore.run) and wait for it; a core never started ends on this thread, where
        nobody listens to its outputs."""
        self._stop.set()
        if self._thread is None:
            self.engine_core.run(self._stop, self._requests.end)
            return
        self.engine_core.wake()
        self._thread.join()
