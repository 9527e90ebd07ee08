"""The engine core in a process of its own, so that the step loop does not share an interpreter lock with the front end.

In one process the event loop (gRPC, the output processor's detokenization, each stream's wake-up) and the step
thread take turns on one GIL: each millisecond of front-end Python is a millisecond the step thread, and the
device it feeds, waits (benchmarks/probes/host_overhead.py --front-end: at 256 streams a step's host work is
2.7 ms alone and 7-10 ms beside the front end). `CoreClient` starts the core in a fresh interpreter (a fork would
inherit the parent's threads and CUDA state) and stands in for `EngineCore` in `AsyncEngine`: the same
submit / abort / query_session / stats / run, over two pipes.

The messages are core_messages.py's, the child's side is core_child.py. Requests carry their constraint as a
spec: the child compiles it again (its own cache), because a grammar's state cannot cross processes; the front
end compiled it first, so refusals are answered here.

The parent numbers the requests (the handles), so that `after` and `abort` need no round trip. When the child
dies, every request it held ends with ERROR and the client reports the engine dead, as a dead core does.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from llmserve.engine import core_messages as messages
from llmserve.engine.commands import Abort, Add, Emit
from llmserve.engine.core_messages import ChildSpec
from llmserve.engine.facts import CoreFacts, validate
from llmserve.engine.kv_events import KvEvent, KvEventLog
from llmserve.engine.outputs import EngineOutput
from llmserve.engine.protocol import EngineStats, SessionInfo
from llmserve.engine.request import EngineDead, FinishReason, GenerationRequest

if TYPE_CHECKING:
    from llmserve.engine.constraints import ConstraintState
    from llmserve.models import LoadedModel

__all__ = ["ChildSpec", "CoreClient", "load_served_model"]

log = logging.getLogger(__name__)

# How long the child may take to load the model and warm up, and to end after Stop, before it is killed.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
# The most outputs of passes that queued up handed to the front end as one batch.
MAX_MERGED = 4096


class CoreClient:
    """The front end's side of a core in a child process; `AsyncEngine(core=...)` drives it like an EngineCore.

    The constructor starts the child and returns at once; `wait_ready` (seconds: the child loads the model) raises
    RuntimeError when the child failed or exited. Thread-safety as EngineCore's: any thread may submit, abort,
    query and read stats; one thread runs `run`.
    """

    def __init__(self, spec: ChildSpec) -> None:
        # A fresh interpreter on two pipes (not multiprocessing's spawn, which re-runs the parent's __main__).
        commands_in, commands_out = os.pipe()
        events_in, events_out = os.pipe()
        # It imports what this process imports (as multiprocessing's spawn does): the ChildSpec's functions too.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llmserve.engine.core_child", str(commands_in), str(events_out)],
            pass_fds=(commands_in, events_out),
            env=env,
        )
        os.close(commands_in)
        os.close(events_out)
        self._commands_out = Connection(commands_out, readable=False)
        self._events = Connection(events_in, writable=False)
        self._commands_out.send(spec)
        self._send_lock = threading.Lock()
        self._handles = itertools.count(1)
        self._queries = itertools.count(1)
        self._pending: dict[int, Future[SessionInfo | bool | None]] = {}
        self._live: dict[int, str] = {}  # handle -> request id, of every request the child may still hold
        self._live_lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._stopping = False
        self.loaded: LoadedModel | None = None
        self.facts: CoreFacts | None = None
        self._stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self._kv_events = KvEventLog()  # the child's, as they arrive with its passes, until taken

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._events.poll(0.2):
            if self.process.poll() is not None:
                raise self._exited_while_starting()
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the engine process did not start within {timeout_s:g} s")
        try:
            message = self._events.recv()
        except (EOFError, OSError):
            self._join()
            raise self._exited_while_starting() from None
        if isinstance(message, messages.Failed):
            self._join()
            if message.exception is not None:
                raise message.exception from RuntimeError(message.error)
            raise RuntimeError(message.error)
        assert isinstance(message, messages.Ready)
        self.loaded, self.facts, self._stats = message.loaded, message.facts, message.stats

    # -- EngineCore's interface, as AsyncEngine uses it --------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        validate(request, self._facts())

    def submit(
        self, request: GenerationRequest, constraint: ConstraintState | None = None, *, after: int | None = None
    ) -> int:
        """Send a request; its constraint (if any) is compiled again in the child from `request.constraint`, so the
        state compiled here is not sent."""
        handle = next(self._handles)
        with self._live_lock:
            self._live[handle] = request.request_id
        self._send(Add(handle, request, time.monotonic(), None, after))
        return handle

    def abort(self, handle: int, keep_generated: int | None = None) -> None:
        self._send(Abort(handle, keep_generated))

    def wake(self) -> None:
        """The front end sets the stop flag, then wakes the loop: here that is the moment to tell the child."""
        if self._stop is not None and self._stop.is_set() and not self._stopping:
            self._stopping = True
            self._send(messages.Stop())

    def drain_inbox(self) -> None:
        """Nothing to do here: the child drains its own inbox."""

    def warm_up(self) -> None:
        """Nothing to do here: the child warmed up before it said it was ready."""

    def query_session(self, session_id: str, *, delete: bool = False) -> Future[SessionInfo | bool | None]:
        reply: Future[SessionInfo | bool | None] = Future()
        if self.dead_reason is not None:
            reply.set_exception(EngineDead(self.dead_reason))
            return reply
        number = next(self._queries)
        self._pending[number] = reply
        self._send(messages.Query(number, session_id, delete))
        return reply

    @property
    def num_running(self) -> int:
        return 0 if self.dead_reason is not None else self.stats().running  # a dead core runs nothing

    @property
    def num_waiting(self) -> int:
        """Requests sent and not yet running, as of the child's last report (a pass late at most)."""
        return max(0, len(self._live) - self.num_running)

    def stats(self) -> EngineStats:
        """The child's stats as of its last pass (or reply)."""
        assert self._stats is not None, "wait_ready() first"
        return self._stats

    def take_kv_events(self) -> list[KvEvent]:
        """The child's prefix-cache events that have arrived since the last call."""
        return self._kv_events.take()

    def run(self, stop: threading.Event, emit: Emit) -> None:
        """On the front end's engine thread: hand the child's passes to `emit` until the child ends. Passes that
        arrived while the front end was busy go out as one (at most MAX_MERGED outputs): a front end slower than
        the step loop catches up by handling fewer, fuller batches (and its streams fewer, fuller deltas)."""
        self._stop = stop
        if stop.is_set():
            self.wake()
        merged: list[EngineOutput] = []
        while True:
            if merged and (len(merged) >= MAX_MERGED or not self._events.poll(0)):
                emit(merged)
                merged = []
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                if merged:
                    emit(merged)
                self._lost(emit)
                return
            if isinstance(message, messages.Outputs):
                self.dead_reason, self._stats = message.dead_reason, message.stats
                self._kv_events.extend(message.kv_events)
                merged.extend(self._decode(message.items))
                continue
            if merged:  # what came before a reply or the end goes out first
                emit(merged)
                merged = []
            if isinstance(message, messages.Reply):
                future = self._pending.pop(message.number, None)
                if future is not None:
                    future.set_result(message.answer)
            elif isinstance(message, messages.Bye):
                self._join()
                return

    def kill(self) -> None:
        """End the child now (a start cut short, a child that does not stop)."""
        if self.process.poll() is None:
            self.process.kill()
        self._join()

    # -- internals -------------------------------------------------------------------------------

    def _exited_while_starting(self) -> RuntimeError:
        return RuntimeError(f"the engine process exited (exit code {self.process.returncode}) while starting")

    def _join(self) -> None:
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("the engine process did not exit within %g s: killing it", STOP_TIMEOUT_S)
            self.process.kill()
            self.process.wait()

    def _facts(self) -> CoreFacts:
        assert self.facts is not None, "wait_ready() first"
        return self.facts

    def _decode(self, items: list[messages.Item]) -> list[EngineOutput]:
        live = self._live
        outputs: list[EngineOutput] = []
        finished: list[int] = []
        for item in items:
            if isinstance(item, EngineOutput):
                outputs.append(item)
                if item.finish_reason is not None:
                    finished.append(item.handle)
            else:
                outputs.append(EngineOutput(item[0], live.get(item[0], ""), item[1]))
        if finished:
            with self._live_lock:
                for handle in finished:
                    live.pop(handle, None)
        return outputs

    def _send(self, message: object) -> None:
        try:
            with self._send_lock:
                self._commands_out.send(message)
        except (BrokenPipeError, OSError):
            pass  # the child is gone: run() sees its pipe close and ends what it held

    def _lost(self, emit: Emit) -> None:
        """The child's pipe closed without a Bye: it died. Everything it held ends with ERROR."""
        self._join()
        reason = self.dead_reason or f"the engine process exited (exit code {self.process.returncode})"
        self.dead_reason = reason
        log.error("engine is dead: %s", reason)
        with self._live_lock:
            live, self._live = self._live, {}
        emit([EngineOutput(h, rid, [], finish_reason=FinishReason.ERROR, error=reason) for h, rid in live.items()])
        for future in list(self._pending.values()):
            future.set_exception(EngineDead(reason))
        self._pending.clear()


def load_served_model(*args: Any, **kwargs: Any) -> LoadedModel:
    """llmserve.models.load_model, imported when called: a ChildSpec's `load` that this process can name without
    loading torch (the server starts its engine process before it imports the rest)."""
    from llmserve.models import load_model

    return load_model(*args, **kwargs)
