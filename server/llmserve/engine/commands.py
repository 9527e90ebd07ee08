"""The step loop's inbox: the commands other threads send the engine core, and the callback it emits through.

Everything a thread other than the step thread asks of the engine is one of these, queued and applied when the
inbox is next drained, so the step thread alone touches the books (no lock).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.engine.outputs import EngineOutput
from llmserve.engine.protocol import SessionInfo
from llmserve.engine.request import GenerationRequest

if TYPE_CHECKING:
    from llmserve.engine.constraints import ConstraintState


@dataclass(slots=True, frozen=True)
class Add:
    """Start serving `request` under `handle`."""

    handle: int
    request: GenerationRequest
    arrival: float  # time.monotonic()
    constraint: ConstraintState | None = None  # the compiled constraint's fresh state, when the request has one
    # The handle of completion 0 of the same n > 1 request: this one is admitted once that one's prompt is
    # computed, and reuses its KV blocks (engine/fanout.py).
    after: int | None = None


@dataclass(slots=True, frozen=True)
class Abort:
    """Stop the request `submit` returned `handle` for; its final output says CANCELLED.

    With `keep_generated` the front end ended the request itself (a stop string in its text after that many
    generated tokens): tokens past those are dropped, so the session keeps exactly what the caller was sent,
    and the request finishes as STOP_SEQUENCE."""

    handle: int
    keep_generated: int | None = None


@dataclass(slots=True, frozen=True)
class SessionQuery:
    """Read (`delete` False: a SessionInfo or None) or delete (True: whether anything was held) a cached session;
    the answer comes through `reply` from the thread that drains the inbox."""

    session_id: str
    delete: bool
    reply: Future[SessionInfo | bool | None]


Command = Add | Abort | SessionQuery
Emit = Callable[[list[EngineOutput]], None]
