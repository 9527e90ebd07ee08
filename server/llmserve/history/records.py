"""What a history store holds and what a call leaves in it: a session's `History`, a call's `Turn` from its start
to its end, and the `Finished` conversation a turn commits."""

from __future__ import annotations

import asyncio
import enum
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llmserve.engine.types.outputs import Delta, FinishReason
from llmserve.history.reasons import reason_tokens

# A turn is recorded only when the call produced a whole answer.
NORMAL_FINISH = frozenset(
    {
        FinishReason.EOS,
        FinishReason.LENGTH,
        FinishReason.STOP_SEQUENCE,
        FinishReason.STOP_TOKEN,
        FinishReason.CONSTRAINT,
    }
)
# Bytes charged per held message on top of its UTF-8 text: an estimate that keeps many tiny messages from
# looking free.
MESSAGE_OVERHEAD_BYTES = 128
# Bytes charged per history on top of its tokens and messages.
HISTORY_OVERHEAD_BYTES = 256

Message = tuple[str, str]  # (role, content)


class HistoryInput(enum.Enum):
    """The kind of input a history was built from, and so the kind that may continue it."""

    CHAT = "chat"
    TOKENS = "tokens"  # text or token ids


@dataclass(slots=True)
class History:
    """A session's conversation so far: the token ids the model read and wrote in its last call, and for
    chat the messages, the last answer included as the final assistant message. `last_used` is on the
    store's clock (monotonic for memory, wall seconds for the durable stores)."""

    kind: HistoryInput
    token_ids: array[int]
    messages: tuple[Message, ...]
    turns: int
    last_used: float
    last_used_wall: float
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.nbytes = footprint(self.token_ids, self.messages)


def footprint(token_ids: array[int], messages: Sequence[Message]) -> int:
    """Bytes a history is charged against --session-history-mib: its serialized size plus fixed overheads."""
    text = sum(len(r.encode()) + len(c.encode()) + MESSAGE_OVERHEAD_BYTES for r, c in messages)
    return HISTORY_OVERHEAD_BYTES + 4 * len(token_ids) + text


@dataclass(slots=True, frozen=True)
class Finished:
    """What a finished turn leaves behind, composed from its prompt and answer; `end_reason` is set when it
    reached the per-session token cap, so that the store ends the history (with that reason) instead of
    holding it."""

    kind: HistoryInput
    token_ids: array[int]
    messages: tuple[Message, ...]
    turns: int
    end_reason: str | None = None


class TurnStore(Protocol):
    """What a turn asks of the store it began in (store.HistoryStore): to commit it, and to release its lease."""

    async def commit(self, turn: Turn) -> None: ...

    async def release(self, turn: Turn) -> None: ...


@dataclass(slots=True, eq=False)
class Turn:
    """One call with a session id, from its start to its end; it writes the history when it finishes normally.

    `held` is the history a continuing call read; `epoch` counts the session's deletions as `start()` saw
    them (a turn that finishes after a deletion writes nothing); `lease` the continuing call's lease token.
    `begin()` tells what the call sends to the engine (api/prompts.py composes it); `observe()` collects the
    answer from the engine's deltas and commits the history before the final delta goes out.
    """

    store: TurnStore
    key: str
    request_id: str
    held: History | None
    epoch: int = 0
    lease: str | None = None
    kind: HistoryInput | None = None
    prompt_ids: list[int] = field(default_factory=list)
    messages: tuple[Message, ...] = ()
    max_tokens: int | None = None
    answer_ids: list[int] = field(default_factory=list)
    answer_text: list[str] = field(default_factory=list)
    dropped: bool = False  # the session was deleted meanwhile: write nothing
    done: bool = False
    renewal: asyncio.Task[None] | None = None

    @property
    def continues(self) -> bool:
        return self.held is not None

    def begin(
        self,
        kind: HistoryInput,
        prompt_ids: Sequence[int],
        messages: Sequence[Message] = (),
        *,
        max_tokens: int | None = None,
    ) -> None:
        """The call's prompt (and for chat its messages); `max_tokens`: the per-session token cap at which the
        finished conversation ends the history (None: none)."""
        self.kind = kind
        self.prompt_ids = list(prompt_ids)
        self.messages = tuple(messages)
        self.max_tokens = max_tokens

    async def observe(self, delta: Delta) -> None:
        """Collect a delta; on a normal finish, commit the turn (raises what the commit raises)."""
        self.answer_ids.extend(delta.token_ids)
        self.answer_text.append(delta.text)
        if delta.finish_reason in NORMAL_FINISH and not self.done and self.kind is not None:
            self.done = True
            await self.store.commit(self)

    def finished(self) -> Finished:
        """The history this turn leaves: its prompt then its answer (for chat, the answer as a message)."""
        if self.kind is None:
            raise ValueError("the turn has not begun")
        token_ids = array("i", self.prompt_ids)
        token_ids.extend(self.answer_ids)
        if self.kind is HistoryInput.CHAT:
            messages = (*self.messages, ("assistant", "".join(self.answer_text)))
            turns = sum(1 for role, _ in messages if role == "assistant")
        else:
            messages = ()
            turns = self.held.turns + 1 if self.held is not None else 1
        cap = self.max_tokens
        end_reason = reason_tokens(cap) if cap is not None and len(token_ids) >= cap else None
        return Finished(self.kind, token_ids, messages, turns, end_reason)

    async def release(self) -> None:
        """The call is over (however it ended); idempotent, never raises."""
        await self.store.release(self)
