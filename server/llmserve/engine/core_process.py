"""The `Core` in an engine process of its own (`ProcessCore`), so that the step loop does not share an interpreter
lock with the front end.

In one process the event loop (gRPC, the output processor's detokenization, each stream's wake-up) and the step
thread take turns on one GIL: each millisecond of front-end Python is a millisecond the step thread, and the
device it feeds, waits (benchmarks/probes/host_overhead.py --front-end: at 256 streams a step's host work is
2.7 ms alone and 7-10 ms beside the front end). `ProcessCore` starts `EngineCore` in a fresh interpreter (a fork
would inherit the parent's threads and CUDA state: core_child.py) and talks to it over two pipes
(core_messages.py). A constrained request travels with its spec: the engine process compiles it (the front end
only checked it).

The client numbers the requests (core_client.InFlight) and keeps, for each, what it has seen of it (its first
token's accounts, the tokens since): when the child dies, every request it held ends with ERROR and its usage, the
pending session queries fail, and the core is dead. After `Bye` (a stop) the same happens with CANCELLED to what the
child never took in. Nothing here imports torch: the server starts its engine process before it loads torch.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, TypeVar, cast

from llmserve.engine import core_messages as messages
from llmserve.engine.commands import Abort, Add, Emit
from llmserve.engine.core_client import InFlight
from llmserve.engine.core_messages import ChildSpec
from llmserve.engine.delta import FinishReason
from llmserve.engine.errors import EngineDead
from llmserve.engine.facts import CoreFacts
from llmserve.engine.kv_events import KvEvent, KvEventLog
from llmserve.engine.lora.catalog import AdapterAnswer, AdapterOp
from llmserve.engine.outputs import EngineOutput, RequestStart, ended, ended_unstarted
from llmserve.engine.protocol import EngineStats, SessionInfo
from llmserve.engine.request import GenerationRequest

if TYPE_CHECKING:
    from llmserve.model_card import ModelCard
    from llmserve.models import LoadedModel

__all__ = ["ChildSpec", "ProcessCore", "load_served_model"]

log = logging.getLogger(__name__)

# How long the child may take to load the model and warm up, and to end after Stop, before it is killed.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
# The most outputs of passes that queued up handed to the front end as one batch.
MAX_MERGED = 4096
STOPPED = "the engine has stopped"
T = TypeVar("T")


@dataclass(slots=True, eq=False)
class _Seen:
    """What the client has seen of one request: enough to end it with its usage if the child cannot."""

    request_id: str
    num_prompt: int
    arrival: float  # time.monotonic() when it was sent (the clock is the machine's: the child's too)
    start: RequestStart | None = None
    num_generated: int = 0

    def final(self, handle: int, reason: FinishReason, error: str) -> EngineOutput:
        start = self.start
        if start is None:
            return ended_unstarted(handle, self.request_id, self.num_prompt, self.arrival, reason, error)
        usage, timing = start.usage(self.num_generated), start.timing(time.monotonic())
        return ended(handle, self.request_id, reason, usage, timing, seed=start.seed, error=error)


class ProcessCore:
    """The front end's side of a core in a child process (core_client.Core).

    The constructor starts the child and returns at once; `wait_ready` (seconds: the child loads the model and warms
    up) raises RuntimeError when the child failed or exited, or the child's own exception when it pickled.
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
        self._commands = Connection(commands_out, readable=False)
        self._events = Connection(events_in, writable=False)
        self._commands.send(spec)
        self._send_lock = threading.Lock()
        self._requests: InFlight[_Seen] = InFlight()
        # Under _lock: why the core ended (None while it serves), and the session commands awaiting their answer,
        # so that none is registered after the core ended and left unanswered.
        self._lock = threading.Lock()
        self._ended: str | None = None
        self._numbers = 0
        self._queries: dict[int, Future[SessionInfo | None]] = {}
        self._deletes: dict[int, Future[bool]] = {}
        self._adapter_calls: dict[int, Future[AdapterAnswer]] = {}
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.card: ModelCard | None = None  # the model as the child describes it (no weights), once ready
        self._facts: CoreFacts | None = None
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
        self.card, self._facts, self._stats = message.card, message.facts, message.stats

    # -- core_client.Core ------------------------------------------------------------------------

    @property
    def facts(self) -> CoreFacts:
        assert self._facts is not None, "wait_ready() first"
        return self._facts

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def num_running(self) -> int:
        return 0 if self.dead_reason is not None else self._last_stats().running  # a dead core runs nothing

    @property
    def num_waiting(self) -> int:
        return self._requests.waiting(self.num_running)

    def stats(self) -> EngineStats:
        """The child's stats as of its last pass, with the client's waiting count."""
        return self._requests.stats(self._last_stats())

    def start(self, emit: Emit) -> None:
        """Start the thread that hands the child's passes to `emit` (the child warmed up before it was ready)."""
        self._reader = threading.Thread(target=self._read, args=(emit,), name="llmserve-engine-events", daemon=True)
        self._reader.start()

    def add(self, request: GenerationRequest, *, after: int | None = None) -> int:
        arrival = time.monotonic()
        with self._lock:
            if self._ended is not None:
                raise EngineDead(self._ended)
            handle = self._requests.add(_Seen(request.request_id, len(request.prompt_token_ids), arrival))
        self._send(Add(handle, request, arrival, after))
        return handle

    def abort(self, handle: int, keep_generated: int | None = None) -> None:
        self._send(Abort(handle, keep_generated))

    def get_session(self, session_id: str) -> Future[SessionInfo | None]:
        reply: Future[SessionInfo | None] = Future()
        number = self._register(self._queries, reply)
        if number is not None:
            self._send(messages.SessionQuery(number, session_id))
        return reply

    def delete_session(self, session_id: str) -> Future[bool]:
        reply: Future[bool] = Future()
        number = self._register(self._deletes, reply)
        if number is not None:
            self._send(messages.SessionDelete(number, session_id))
        return reply

    def manage_adapters(self, op: AdapterOp) -> Future[AdapterAnswer]:
        reply: Future[AdapterAnswer] = Future()
        number = self._register(self._adapter_calls, reply)
        if number is not None:
            self._send(messages.AdapterCall(number, op))
        return reply

    def stop(self) -> None:
        """Tell the child to stop and wait until it has said Bye and exited (or died)."""
        with self._lock:
            stopping, self._stopping = self._stopping, True
        if not stopping:
            self._send(messages.Stop())
        if self._reader is None:  # never started: nobody listens to its outputs
            self._read(self._requests.end)
        else:
            self._reader.join()

    def kill(self) -> None:
        """End the child now (a start cut short, a child that does not stop)."""
        if self.process.poll() is None:
            self.process.kill()
        self._join()

    def take_kv_events(self) -> list[KvEvent]:
        """The child's prefix-cache events that have arrived with its passes since the last call."""
        return self._kv_events.take()

    # -- the reader thread -----------------------------------------------------------------------

    def _read(self, emit: Emit) -> None:
        """Hand the child's passes to `emit` until the child ends. Passes that arrived while the front end was busy
        go out as one (at most MAX_MERGED outputs): a front end slower than the step loop catches up by handling
        fewer, fuller batches (and its streams fewer, fuller deltas)."""
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
                self._join()
                reason = self.dead_reason or f"the engine process exited (exit code {self.process.returncode})"
                self.dead_reason = reason
                log.error("engine is dead: %s", reason)
                self._end(emit, FinishReason.ERROR, reason)
                return
            if isinstance(message, messages.Outputs):
                self.dead_reason, self._stats = message.dead_reason, message.stats
                self._kv_events.extend(message.kv_events)
                merged.extend(self._decode(message.items))
                continue
            if merged:  # what came before an answer or the end goes out first
                emit(merged)
                merged = []
            if isinstance(message, messages.SessionAnswer):
                self._answer(self._queries, message.number, message.info, message.refused)
            elif isinstance(message, messages.SessionDeleted):
                self._answer(self._deletes, message.number, message.deleted, message.refused)
            elif isinstance(message, messages.AdapterReply):
                answer = cast(AdapterAnswer, message.answer)  # None only with an error or a refusal
                self._answer(self._adapter_calls, message.number, answer, message.refused, message.error)
            elif isinstance(message, messages.Bye):
                self._join()
                self._end(emit, FinishReason.CANCELLED, STOPPED)
                return

    def _decode(self, items: list[messages.Item]) -> list[EngineOutput]:
        """A pass's items as outputs, counting what each request was sent (one loop: it runs for every token)."""
        requests = self._requests
        seen_of = requests.get
        outputs: list[EngineOutput] = []
        for item in items:
            if isinstance(item, EngineOutput):
                output = item
                seen = seen_of(output.handle)
                if seen is not None:
                    if output.start is not None:
                        seen.start = output.start
                    seen.num_generated += len(output.token_ids)
                    if output.finish_reason is not None:
                        requests.discard(output.handle)
            else:
                handle, tokens = item
                seen = seen_of(handle)
                if seen is not None:
                    seen.num_generated += len(tokens)
                output = EngineOutput(handle, "" if seen is None else seen.request_id, tokens)
            outputs.append(output)
        return outputs

    def _end(self, emit: Emit, reason: FinishReason, why: str) -> None:
        """The child is gone: every request it did not end ends here, every session command fails."""
        with self._lock:
            self._ended = why
            queries, self._queries = self._queries, {}
            deletes, self._deletes = self._deletes, {}
            calls, self._adapter_calls = self._adapter_calls, {}
        finals = [seen.final(handle, reason, why) for handle, seen in self._requests.take_all().items()]
        if finals:
            emit(finals)
        for query in queries.values():
            query.set_exception(EngineDead(why))
        for delete in deletes.values():
            delete.set_exception(EngineDead(why))
        for call in calls.values():
            call.set_exception(EngineDead(why))

    # -- internals -------------------------------------------------------------------------------

    def _register(self, pending: dict[int, Future[T]], reply: Future[T]) -> int | None:
        """Number a session command and keep its future, or fail it when the core has ended (under the lock that
        `_end` takes, so that no future is kept after the last answers were given)."""
        with self._lock:
            if self._ended is not None:
                reply.set_exception(EngineDead(self._ended))
                return None
            self._numbers += 1
            pending[self._numbers] = reply
            return self._numbers

    def _answer(
        self,
        pending: dict[int, Future[T]],
        number: int,
        answer: T,
        refused: str | None,
        error: BaseException | None = None,
    ) -> None:
        with self._lock:
            future = pending.pop(number, None)
        if future is None:
            return
        if refused is not None or error is not None:
            future.set_exception(error if error is not None else EngineDead(str(refused)))
        else:
            future.set_result(answer)

    def _last_stats(self) -> EngineStats:
        assert self._stats is not None, "wait_ready() first"
        return self._stats

    def _exited_while_starting(self) -> RuntimeError:
        return RuntimeError(f"the engine process exited (exit code {self.process.returncode}) while starting")

    def _join(self) -> None:
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("the engine process did not exit within %g s: killing it", STOP_TIMEOUT_S)
            self.process.kill()
            self.process.wait()

    def _send(self, message: object) -> None:
        try:
            with self._send_lock:
                self._commands.send(message)
        except (BrokenPipeError, OSError):
            pass  # the child is gone: the reader sees its pipe close and ends what it held


def load_served_model(*args: Any, **kwargs: Any) -> LoadedModel:
    """llmserve.models.load_model, imported when called: a ChildSpec's `load` that this process can name without
    loading torch (the server starts its engine process before it imports the rest)."""
    from llmserve.models import load_model

    return load_model(*args, **kwargs)
