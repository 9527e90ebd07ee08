"""The step loop's inbox: the commands other threads send the engine core, and the callback it emits through.

Everything a thread other than the step thread asks of the engine is one of these, queued and applied when the
inbox is next drained, so the step thread alone touches the books (no lock). A session query carries the future
its typed answer comes back through.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from llmserve.engine.lora.catalog import AdapterAnswer, AdapterOp
from llmserve.engine.outputs import EngineOutput
from llmserve.engine.protocol import SessionInfo
from llmserve.engine.request import GenerationRequest


@dataclass(slots=True, frozen=True)
class Add:
    """Start serving `request` under `handle` (its constraint, if any, is compiled by the core)."""

    handle: int
    request: GenerationRequest
    arrival: float  # time.monotonic() when the front end gave it to the core
    # The handle of completion 0 of the same n > 1 request: this one is admitted once that one's prompt is
    # computed, and reuses its KV blocks (engine/fanout.py).
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
    """An AdapterService call (lora/catalog.AdapterOp); `adapter` is a load's adapter, read before on another thread
    (lora/serving.LoraServing.prepare), so that the step thread only changes the books."""

    op: AdapterOp
    adapter: Any
    reply: Future[AdapterAnswer]


Command = Add | Abort | GetSession | DeleteSession | ManageAdapters
Emit = Callable[[list[EngineOutput]], None]
