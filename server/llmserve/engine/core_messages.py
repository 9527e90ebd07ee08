"""The messages between the front end and an engine core in a process of its own (core_process.py, core_child.py).

Parent to child: the `ChildSpec` first, then `commands.Add`, `commands.Abort`, `SessionQuery`, `SessionDelete`
and `Stop`. Child to parent: `Ready` (or `Failed`), one `Outputs` per pass of the step loop, a `SessionAnswer` or
`SessionDeleted` per session command, `Bye` at the end. They travel pickled over two pipes. Nothing here imports
torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.engine.config import EngineConfig
from llmserve.engine.facts import CoreFacts
from llmserve.engine.kv_events import KvEvent
from llmserve.engine.lora.catalog import AdapterAnswer, AdapterOp
from llmserve.engine.outputs import EngineOutput
from llmserve.engine.protocol import EngineStats, SessionInfo
from llmserve.model_card import ModelCard

if TYPE_CHECKING:
    from llmserve.models import LoadedModel


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
