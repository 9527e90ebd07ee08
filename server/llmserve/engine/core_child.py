"""The engine process's side of core_process.py: `python -m llmserve.engine.core_child COMMANDS_FD EVENTS_FD`.

It reads its ChildSpec, builds the core (the model loads here), warms up, says Ready, then runs the core's step
loop until the parent says Stop or goes away. Three threads: the step loop; the command thread, which puts each
command from the parent into the core's inbox (compiling a request's constraint first, on the compiler's workers,
so that a slow grammar delays only its own request); the sender, which pickles and writes the messages, so that
the step loop does not wait for the front end to read (unless the front end is OUTBOX_PASSES behind).
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import queue
import signal
import sys
import threading
import traceback
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from llmserve.engine.commands import Abort, Add
from llmserve.engine.core_messages import Bye, ChildSpec, Failed, Outputs, Query, Ready, Reply, Stop, encode
from llmserve.engine.outputs import EngineOutput
from llmserve.engine.protocol import SessionInfo
from llmserve.engine.request import FinishReason, Usage
from llmserve.telemetry.request_log import configure_logging

# Messages the sender may hold before the step loop waits: a front end this far behind (seconds of passes) slows
# the engine down to its own pace instead of buffering without end.
OUTBOX_PASSES = 1024

if TYPE_CHECKING:
    from llmserve.engine.constraints import Compiled, ConstraintCompiler
    from llmserve.engine.core import EngineCore


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
        spec = commands.recv()
        configure_logging(spec.log_level, spec.log_format)
        core, compiler = _build(spec)
    except Exception as exc:
        try:
            pickle.dumps(exc)
            picklable: BaseException | None = exc
        except Exception:
            picklable = None
        send(Failed(f"the engine process could not start:\n{traceback.format_exc()}", picklable))
        sender.join()
        return
    send(Ready(dataclasses.replace(core.loaded, model=None), core.facts, core.stats()))
    stop = threading.Event()
    receiver = threading.Thread(
        target=_Commands(core, compiler, send).run, args=(commands, stop), name="llmserve-commands", daemon=True
    )
    receiver.start()

    core.run(stop, lambda outputs: send(_outputs(core, outputs)))
    if compiler is not None:
        compiler.close()
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


def _outputs(core: EngineCore, outputs: list[EngineOutput]) -> Outputs:
    """A pass's outputs as they travel, with the core's state of that moment."""
    return Outputs(encode(outputs), core.dead_reason, core.stats(), core.take_kv_events())


def _build(spec: ChildSpec) -> tuple[EngineCore, Any]:
    from llmserve.engine.constraints import ConstraintCompiler
    from llmserve.engine.core import EngineCore

    loaded = spec.load()
    core = EngineCore(loaded, spec.config)
    if spec.prepare is not None:
        spec.prepare(core)
    compiler = ConstraintCompiler.for_model(loaded, spec.config)
    core.warm_up()
    return core, compiler


class _Commands:
    """The command thread's state: requests whose constraint is still compiling, and whether each was aborted
    meanwhile (the core does not know them yet)."""

    def __init__(self, core: EngineCore, compiler: ConstraintCompiler | None, send: Any) -> None:
        self.core = core
        self.compiler = compiler
        self.send = send
        self._compiling: dict[int, bool] = {}  # handle -> aborted
        self._lock = threading.Lock()

    def run(self, commands: Connection, stop: threading.Event) -> None:
        core = self.core
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
                self._add(command)
            elif isinstance(command, Abort):
                with self._lock:
                    if command.handle in self._compiling:
                        self._compiling[command.handle] = True
                        continue
                core.abort(command.handle, command.keep_generated)
            elif isinstance(command, Query):
                future = core.query_session(command.session_id, delete=command.delete)
                future.add_done_callback(functools.partial(self._reply, command.number))

    def _reply(self, number: int, future: Future[SessionInfo | bool | None]) -> None:
        self.send(Reply(number, future.result()))

    def _add(self, command: Add) -> None:
        spec = command.request.constraint
        if spec is None or self.compiler is None:
            self.core.submit(command.request, None, after=command.after, handle=command.handle)
            return
        with self._lock:
            self._compiling[command.handle] = False
        # Compiled (and refused) by the front end first: here it is usually in this process's cache already.
        self.compiler.submit(spec).add_done_callback(functools.partial(self._compiled, command))

    def _compiled(self, command: Add, future: Future[Compiled]) -> None:
        """On the compiler's worker (or this thread, if it was done): queue the request, or end it."""
        with self._lock:
            aborted = self._compiling.pop(command.handle)
        request = command.request
        reason, error = FinishReason.CANCELLED, None
        if not aborted:
            try:
                state = future.result().start()
            except Exception as exc:
                reason, error = FinishReason.ERROR, f"its constraint did not compile in the engine process: {exc}"
            else:
                self.core.submit(request, state, after=command.after, handle=command.handle)
                return
        usage = Usage(len(request.prompt_token_ids), 0, 0)
        ended = EngineOutput(command.handle, request.request_id, [], finish_reason=reason, usage=usage, error=error)
        self.send(_outputs(self.core, [ended]))


if __name__ == "__main__":
    # Through the module by its name: what this process pickles must name llmserve.engine's classes, not __main__'s.
    from llmserve.engine import core_child

    core_child._child_main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
