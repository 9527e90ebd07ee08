"""The engine process's side of core_process.py: `python -m llmserve.engine.core_child COMMANDS_FD EVENTS_FD`.

It reads its ChildSpec, builds the core (the model loads here), warms up, says Ready, then runs the core's step
loop until the parent says Stop or goes away. Three threads: the step loop; the command thread, which puts each
command from the parent into the core's inbox (the core compiles a request's constraint itself, off the step
thread); the sender, which pickles and writes the messages, so that the step loop does not wait for the front end
to read (unless the front end is OUTBOX_PASSES behind).
"""

from __future__ import annotations

import functools
import pickle
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from llmserve.engine.commands import Abort, Add
from llmserve.engine.core_messages import (
    AdapterCall,
    AdapterReply,
    Bye,
    ChildSpec,
    Failed,
    Outputs,
    Ready,
    SessionAnswer,
    SessionDelete,
    SessionDeleted,
    SessionQuery,
    Stop,
    encode,
)
from llmserve.engine.errors import EngineDead
from llmserve.engine.lora.catalog import AdapterAnswer
from llmserve.engine.outputs import EngineOutput
from llmserve.engine.protocol import SessionInfo
from llmserve.telemetry.request_log import configure_logging

if TYPE_CHECKING:
    from llmserve.engine.core import EngineCore

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
    from llmserve.engine.core import EngineCore

    core = EngineCore(spec.load(), spec.config)
    core.warm_up()
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


if __name__ == "__main__":
    # Through the module by its name: what this process pickles must name llmserve.engine's classes, not __main__'s.
    from llmserve.engine import core_child

    core_child._child_main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
