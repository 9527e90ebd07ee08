"""The `Core` in an engine process of its own, so that the step loop does not share an interpreter lock with the
front end: both ends of the two pipes, and the messages that cross them.

In one process the event loop (gRPC, the output processor's detokenization, each stream's wake-up) and the step
thread take turns on one GIL: each millisecond of front-end Python is a millisecond the step thread, and the
device it feeds, waits (benchmarks/probes/host_overhead.py --front-end: at 256 streams a step's host work is
2.7 ms alone and 7-10 ms beside the front end).

The parent's side is `ProcessCore` (a client.Core). It starts `python -m llmserve.engine.core.process` in a
fresh interpreter (a fork would inherit the parent's threads and CUDA state) and talks to it over two pipes; a
`launch` of another kind runs the same `run_child` otherwise (the test session forks it from an interpreter that has
imported torch and transformers once: tests/forking_launcher.py, 4.4 CPU-s saved an engine process). A
constrained request travels with its spec: the engine process compiles it (the front end only checked it). The
client numbers the requests (client.ClientRequests) and keeps, for each, what it has seen of it (its first token's
accounts, the tokens since): when the child dies, every request it held ends with ERROR and its usage, the pending
session queries fail, and the core is dead. After `Bye` (a stop) the same happens with CANCELLED to what the child
never took in. Nothing the parent runs imports torch: the server starts its engine process before it loads torch.

The child's side (`_child_main`) reads its ChildSpec, builds the core (the model loads there), warms up, says Ready,
then runs the core's step loop until the parent says Stop or goes away. Three threads: the step loop; the command
thread, which puts each command from the parent into the core's inbox (the core compiles a request's constraint
itself, off the step thread); the sender, which pickles and writes the messages, so that the step loop does not
wait for the front end to read (unless the front end is OUTBOX_PASSES behind).

The messages. Parent to child: the `ChildSpec` first, then client.Add, client.Abort, `SessionQuery`,
`SessionDelete`, `AdapterCall` and `Stop`. Child to parent: `Ready` (or `Failed`), one `Outputs` per pass of the
step loop, a `SessionAnswer`, `SessionDeleted` or `AdapterReply` per such command, `Bye` at the end. They travel
pickled.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar, cast

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.client import STOPPED, Abort, Add, ClientRequests, Emit
from llmserve.engine.sched.kv_events import KvEventLog
from llmserve.engine.types.adapters import AdapterAnswer, AdapterOp
from llmserve.engine.types.errors import EngineDead
from llmserve.engine.types.kv_cache import KvEvent
from llmserve.engine.types.model import ModelCard
from llmserve.engine.types.outputs import EngineOutput, FinishReason, RequestStart, ended, ended_unstarted
from llmserve.engine.types.protocol import EngineStats, SessionInfo
from llmserve.engine.types.request import CoreFacts, GenerationRequest
from llmserve.telemetry.request_log import configure_logging

if TYPE_CHECKING:
    from llmserve.config import ModelConfig
    from llmserve.engine.core.engine_core import EngineCore
    from llmserve.engine.types.model import LoadedModel

__all__ = ["ChildProcess", "ChildSpec", "Launch", "ProcessCore", "launch_interpreter", "load_served_model", "run_child"]

log = logging.getLogger(__name__)

# How long the child may take to load the model and warm up, and to end after Stop, before it is killed.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
# The most outputs of passes that queued up handed to the front end as one batch.
MAX_MERGED = 4096
T = TypeVar("T")


class ChildProcess(Protocol):
    """What ProcessCore needs of its child's process: subprocess.Popen's part (`returncode` as Popen gives it: the
    exit status, or minus the signal that ended it)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


# Starts the engine process on the read end of the commands pipe and the write end of the events pipe (the fds as
# this process holds them): `launch_interpreter` below, or a launcher that runs the same `run_child` otherwise.
Launch = Callable[[int, int], ChildProcess]


def child_environment() -> dict[str, str]:
    """The child's environment: this process's, with its import path (as multiprocessing's spawn does), so that the
    child imports what this process imports, the ChildSpec's functions too."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))


def launch_interpreter(commands: int, events: int) -> ChildProcess:
    """The engine process as `python -m llmserve` starts it: a fresh interpreter on the two pipes' ends (not
    multiprocessing's spawn, which re-runs the parent's __main__, nor a fork, which would inherit the parent's threads
    and CUDA state)."""
    return subprocess.Popen(
        [sys.executable, "-m", "llmserve.engine.core.process", str(commands), str(events)],
        pass_fds=(commands, events),
        env=child_environment(),
    )


@dataclass(slots=True, eq=False)
class _Accounts:
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
    """The front end's side of a core in a child process (client.Core).

    The constructor starts the child with `launch` (a fresh interpreter unless told otherwise) and returns at once;
    `wait_ready` (seconds: the child loads the model and warms up) raises RuntimeError when the child failed or
    exited, or the child's own exception when it pickled.
    """

    def __init__(self, spec: ChildSpec, launch: Launch | None = None) -> None:
        commands_in, commands_out = os.pipe()
        events_in, events_out = os.pipe()
        self.process: ChildProcess = (launch or launch_interpreter)(commands_in, events_out)
        os.close(commands_in)
        os.close(events_out)
        self._commands = Connection(commands_out, readable=False)
        self._events = Connection(events_in, writable=False)
        self._commands.send(spec)
        self._send_lock = threading.Lock()
        self._requests: ClientRequests[_Accounts] = ClientRequests()
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
        if isinstance(message, Failed):
            self._join()
            if message.exception is not None:
                raise message.exception from RuntimeError(message.error)
            raise RuntimeError(message.error)
        assert isinstance(message, Ready)
        self.card, self._facts, self._stats = message.card, message.facts, message.stats

    # -- client.Core -----------------------------------------------------------------------------

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
            handle = self._requests.add(_Accounts(request.request_id, len(request.prompt_token_ids), arrival))
        self._send(Add(handle, request, arrival, after))
        return handle

    def abort(self, handle: int, keep_generated: int | None = None) -> None:
        self._send(Abort(handle, keep_generated))

    def get_session(self, session_id: str) -> Future[SessionInfo | None]:
        return self._ask(self._queries, lambda number: SessionQuery(number, session_id))

    def delete_session(self, session_id: str) -> Future[bool]:
        return self._ask(self._deletes, lambda number: SessionDelete(number, session_id))

    def manage_adapters(self, op: AdapterOp) -> Future[AdapterAnswer]:
        return self._ask(self._adapter_calls, lambda number: AdapterCall(number, op))

    def stop(self) -> None:
        """Tell the child to stop and wait until it has said Bye and exited (or died)."""
        with self._lock:
            stopping, self._stopping = self._stopping, True
        if not stopping:
            self._send(Stop())
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
            if isinstance(message, Outputs):
                self.dead_reason, self._stats = message.dead_reason, message.stats
                self._kv_events.extend(message.kv_events)
                merged.extend(self._decode(message.items))
                continue
            if merged:  # what came before an answer or the end goes out first
                emit(merged)
                merged = []
            if isinstance(message, SessionAnswer):
                self._answer(self._queries, message.number, message.info, message.refused)
            elif isinstance(message, SessionDeleted):
                self._answer(self._deletes, message.number, message.deleted, message.refused)
            elif isinstance(message, AdapterReply):
                answer = cast(AdapterAnswer, message.answer)  # None only with an error or a refusal
                self._answer(self._adapter_calls, message.number, answer, message.refused, message.error)
            elif isinstance(message, Bye):
                self._join()
                self._end(emit, FinishReason.CANCELLED, STOPPED)
                return

    def _decode(self, items: list[Item]) -> list[EngineOutput]:
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

    def _ask(self, pending: dict[int, Future[T]], command: Callable[[int], object]) -> Future[T]:
        """Send the command `command(number)` makes, numbered, and keep its answer's future in `pending`; or fail
        the future when the core has ended (under the lock that `_end` takes, so that no future is kept after the
        last answers were given)."""
        reply: Future[T] = Future()
        with self._lock:
            if self._ended is not None:
                reply.set_exception(EngineDead(self._ended))
                return reply
            self._numbers += 1
            number = self._numbers
            pending[number] = reply
        self._send(command(number))
        return reply

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


def load_served_model(model: ModelConfig, lora: bool) -> LoadedModel:
    """The served model (models/loader.load_model, imported when called): a ChildSpec's `load` that this process
    can name without loading torch (the server starts its engine process before it imports the rest)."""
    from llmserve.models.loader import load_model

    cache_root = Path(model.cache_dir) if model.cache_dir else None
    return load_model(
        model.spec,
        device=model.device,
        dtype=model.dtype,
        gguf_activations=model.gguf_activations,
        fp32_matmul=model.fp32_matmul,
        cache_root=cache_root,
        lora=lora,
        pooling=model.pooling,
    )


# -- the messages -----------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class SessionQuery:
    """commands.GetSession across the pipe: the answer comes back as SessionAnswer(number)."""

    number: int
    session_id: str


@dataclass(slots=True, frozen=True)
class SessionDelete:
    """commands.DeleteSession across the pipe: the answer comes back as SessionDeleted(number)."""

    number: int
    session_id: str


@dataclass(slots=True, frozen=True)
class AdapterCall:
    """commands.ManageAdapters across the pipe: the answer comes back as AdapterReply(number)."""

    number: int
    op: AdapterOp


@dataclass(slots=True, frozen=True)
class AdapterReply:
    """The core's answer to an AdapterCall, or the error it raised (pickled as it is: AdapterRefused names the
    file), or why it did not answer (`refused`: it is dead)."""

    number: int
    answer: AdapterAnswer | None
    error: BaseException | None = None
    refused: str | None = None


@dataclass(slots=True, frozen=True)
class Stop:
    """End the step loop: what still runs ends CANCELLED, then the child says Bye and exits."""


@dataclass(slots=True, frozen=True)
class Ready:
    card: ModelCard  # the model without its weights: the tokenizer, the name, the shape, the EOS ids
    facts: CoreFacts
    stats: EngineStats


@dataclass(slots=True, frozen=True)
class Failed:
    """The child could not load the model or build the core: why, with its traceback, and the exception itself
    when it pickles (a DiskTierError stays one, so that the server exits as for bad settings)."""

    error: str
    exception: BaseException | None


# A decode step's usual output (a token, nothing else) travels as (handle, token_ids): pickling 256 EngineOutputs
# cost the step thread 0.85 ms, these 0.10 ms; the rest travel as they are.
Item = tuple[int, list[int]] | EngineOutput


@dataclass(slots=True, frozen=True)
class Outputs:
    items: list[Item]
    dead_reason: str | None
    stats: EngineStats  # its running count is the client's num_running
    kv_events: list[KvEvent]  # the prefix cache's since the last pass (kv_events.py)


@dataclass(slots=True, frozen=True)
class SessionAnswer:
    number: int
    info: SessionInfo | None
    refused: str | None = None  # why the core did not answer (it is dead): EngineDead(refused) for the caller


@dataclass(slots=True, frozen=True)
class SessionDeleted:
    number: int
    deleted: bool
    refused: str | None = None


@dataclass(slots=True, frozen=True)
class Bye:
    """The step loop has ended and the child exits; everything it answered came before this."""


@dataclass(slots=True, frozen=True)
class ChildSpec:
    """What the child needs to build the core: `load` builds the model (picklable: a module-level function or a
    functools.partial of one)."""

    load: Callable[[], LoadedModel]
    config: EngineConfig
    log_level: str = "INFO"
    log_format: str = "text"  # as the server's --log-format


def encode(outputs: list[EngineOutput]) -> list[Item]:
    """A pass's outputs as they travel (see `Item`)."""
    return [
        (o.handle, o.token_ids) if o.logprobs is None and o.start is None and o.finish_reason is None else o
        for o in outputs
    ]


# -- the engine process -----------------------------------------------------------------------------------------

# Messages the sender may hold before the step loop waits: a front end this far behind (seconds of passes) slows
# the engine down to its own pace instead of buffering without end.
OUTBOX_PASSES = 1024

Send = Callable[[object], None]


def _child_main(commands: Connection, events: Connection) -> None:
    """The child's whole life: read its ChildSpec, build the core, say Ready, step until Stop (or until the
    parent's pipe closes)."""
    # Ctrl-C, and a supervisor's SIGTERM, may reach the whole process group: the parent decides when the engine
    # stops, and tells it (or goes away, which closes the pipe). SIGKILL still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The step thread does not wait for the front end (as on a thread of one process, where it hands each pass to
    # the event loop and goes on): messages queue here and a sender thread pickles and writes them, so a pipe
    # that the parent empties slowly blocks the sender, not the step loop, up to OUTBOX_PASSES messages.
    outbox: queue.Queue[object] = queue.Queue(OUTBOX_PASSES)
    send = outbox.put
    sender = threading.Thread(target=_send_all, args=(outbox, events), name="llmserve-events", daemon=True)
    sender.start()

    try:
        spec: ChildSpec = commands.recv()
        configure_logging(spec.log_level, spec.log_format)
        core = _build(spec)
    except Exception as exc:
        try:
            pickle.dumps(exc)
            picklable: BaseException | None = exc
        except Exception:
            picklable = None
        send(Failed(f"the engine process could not start:\n{traceback.format_exc()}", picklable))
        sender.join()
        return
    send(Ready(core.loaded.card(), core.facts, core.stats()))
    stop = threading.Event()
    receiver = threading.Thread(
        target=_receive, args=(commands, core, stop, send), name="llmserve-commands", daemon=True
    )
    receiver.start()

    core.run(stop, lambda outputs: send(_pass_message(core, outputs)))
    send(Bye())
    sender.join()
    events.close()


def _send_all(outbox: queue.Queue[object], events: Connection) -> None:
    while True:
        message = outbox.get()
        try:
            events.send(message)
        except (BrokenPipeError, OSError):  # the parent is gone; the command thread stops the loop
            return
        if isinstance(message, (Bye, Failed)):
            return


def _pass_message(core: EngineCore, outputs: list[EngineOutput]) -> Outputs:
    """A pass's outputs as they travel, with the core's state of that moment."""
    return Outputs(encode(outputs), core.dead_reason, core.stats(), core.take_kv_events())


def _build(spec: ChildSpec) -> EngineCore:
    from llmserve.engine.core.engine_core import EngineCore

    core = EngineCore(spec.load(), spec.config)
    core.warm_up()
    # The model, torch's and the tokenizer's objects (~400,000 on the shipped model) live as long as this process.
    # Frozen, the collector no longer walks them: a full collection of them took ~190 ms, a pause of the step loop
    # (every stream's next token) whenever enough survivors had piled up to trigger one.
    gc.freeze()
    return core


def _receive(commands: Connection, core: EngineCore, stop: threading.Event, send: Send) -> None:
    """The command thread: each command from the parent into the core, until Stop or the parent goes away. A request
    that comes after the core's last drain is not taken in (EngineDead): the parent ends it when the child says Bye
    (so does a session command, whose refusal the sender drops once it has sent Bye)."""
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):  # the parent is gone: stop
            command = Stop()
        if isinstance(command, Stop):
            stop.set()
            core.wake()
            return
        if isinstance(command, Add):
            try:
                core.submit(command.request, after=command.after, handle=command.handle)
            except EngineDead:
                pass
        elif isinstance(command, Abort):
            core.abort(command.handle, command.keep_generated)
        elif isinstance(command, SessionQuery):
            core.get_session(command.session_id).add_done_callback(functools.partial(_answer, send, command.number))
        elif isinstance(command, SessionDelete):
            reply = core.delete_session(command.session_id)
            reply.add_done_callback(functools.partial(_deleted, send, command.number))
        elif isinstance(command, AdapterCall):
            core.manage_adapters(command.op).add_done_callback(functools.partial(_adapters, send, command.number))


def _answer(send: Send, number: int, future: Future[SessionInfo | None]) -> None:
    error = future.exception()
    send(SessionAnswer(number, None, str(error)) if error is not None else SessionAnswer(number, future.result()))


def _deleted(send: Send, number: int, future: Future[bool]) -> None:
    error = future.exception()
    send(SessionDeleted(number, False, str(error)) if error is not None else SessionDeleted(number, future.result()))


def _adapters(send: Send, number: int, future: Future[AdapterAnswer]) -> None:
    error = future.exception()
    if isinstance(error, EngineDead):
        send(AdapterReply(number, None, refused=str(error)))
    else:
        send(AdapterReply(number, None if error is not None else future.result(), error))


def run_child(commands: int, events: int) -> NoReturn:
    """The engine process's whole life on its two pipes' ends (the commands' read end, the events' write end), then
    its exit: `python -m llmserve.engine.core.process COMMANDS EVENTS` runs it, and so may a launcher's fork."""
    _child_main(Connection(commands, writable=False), Connection(events, readable=False))
    # Nothing is left to do: the tiers' writes and the compiler ended before Bye, and Bye (or Failed) is sent. The
    # interpreter's own teardown (a collection over every module object of torch and transformers) would take
    # seconds more, which the parent's stop waits out: skipped, after flushing the log.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # Through the module by its name: what this process pickles must name llmserve.engine's classes, not __main__'s.
    from llmserve.engine.core import process

    process.run_child(int(sys.argv[1]), int(sys.argv[2]))
