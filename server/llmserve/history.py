"""Session histories: what a conversation has said so far, so that a call can send only its new turn.

Every call with a session id that finishes normally leaves its session's history here: the call's whole
input (chat messages, or token ids) and its answer. A call in append mode (`continue_session`) reads it
and appends its own input: chat as the held messages, the answer as an assistant message, then the new
messages; text and token ids as the held token ids followed by the new ones.

The history lives beside the servicer, not in the engine. Chat messages are a service concept (the
engine only ever sees token ids), and the engine's SessionStore is a cache whose blocks the pool takes
back under pressure: a history must outlive that, so it is kept apart and the next turn recomputes what
was evicted. Both stores are keyed by the same session key. A history ends only by the TTL,
`max_sessions`, the memory cap (least recently used first), deletion, or reaching the per-session token
cap; a bounded list of why recent histories ended lets a NOT_FOUND say so.

Pure book-keeping over Python values (no gRPC, no engine state): the servicer translates `NoHistory`
and `HistoryBusy` into status codes.
"""

from __future__ import annotations

import enum
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llmserve.engine.request import Delta, FinishReason, InvalidRequest

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
# Bytes charged per held message on top of its UTF-8 text (the tuple, two str objects): an estimate that keeps
# many tiny messages from looking free.
MESSAGE_OVERHEAD_BYTES = 128
# Bytes charged per history on top of its tokens and messages.
HISTORY_OVERHEAD_BYTES = 256
# How many ended histories remember why they ended (for the NOT_FOUND message).
MAX_TOMBSTONES = 4096

Message = tuple[str, str]  # (role, content)


class HistoryInput(enum.Enum):
    """The kind of input a history was built from, and so the kind that may continue it."""

    CHAT = "chat"
    TOKENS = "tokens"  # text or token ids


@dataclass(slots=True, frozen=True)
class HistoryConfig:
    """Limits of the history store. `max_tokens` None: the model's context length."""

    ttl_s: float = 600.0
    max_sessions: int = 4096
    max_bytes: int = 256 << 20
    max_tokens: int | None = None


class NoHistory(LookupError):
    """No history is held for the session; `reason` says why when the store remembers it."""

    def __init__(self, key: str, reason: str | None) -> None:
        super().__init__(f"no history for session {key!r}" + (f": {reason}" if reason else ""))
        self.key = key
        self.reason = reason


class HistoryBusy(RuntimeError):
    """Another call is continuing the session right now."""

    def __init__(self, key: str, request_id: str) -> None:
        super().__init__(f"session {key!r} is being continued by request {request_id!r}")
        self.key = key
        self.request_id = request_id


@dataclass(slots=True)
class History:
    """A session's conversation so far: the token ids the model read and wrote in its last call, and for
    chat the messages, the last answer included as the final assistant message."""

    kind: HistoryInput
    token_ids: array[int]
    messages: tuple[Message, ...]
    turns: int
    last_used: float
    last_used_wall: float
    nbytes: int = 0

    def __post_init__(self) -> None:
        text = sum(len(r.encode()) + len(c.encode()) + MESSAGE_OVERHEAD_BYTES for r, c in self.messages)
        self.nbytes = HISTORY_OVERHEAD_BYTES + self.token_ids.itemsize * len(self.token_ids) + text


@dataclass(slots=True, eq=False)
class Turn:
    """One call with a session id, from its start to its end; it writes the history when it finishes normally.

    `held` is the history a continuing call read. `begin()` tells what the call sends to the engine;
    `observe()` collects the answer from the engine's deltas and writes the history before the final delta
    goes out, so that a caller who got the last message can continue at once.
    """

    store: HistoryStore
    key: str
    request_id: str
    held: History | None
    kind: HistoryInput | None = None
    prompt_ids: list[int] = field(default_factory=list)
    messages: tuple[Message, ...] = ()
    answer_ids: list[int] = field(default_factory=list)
    answer_text: list[str] = field(default_factory=list)
    dropped: bool = False  # the session was deleted meanwhile: write nothing
    done: bool = False

    @property
    def continues(self) -> bool:
        return self.held is not None

    def begin(self, kind: HistoryInput, prompt_ids: Sequence[int], messages: Sequence[Message] = ()) -> None:
        self.kind = kind
        self.prompt_ids = list(prompt_ids)
        self.messages = tuple(messages)

    def observe(self, delta: Delta) -> None:
        self.answer_ids.extend(delta.token_ids)
        self.answer_text.append(delta.text)
        if delta.finish_reason in NORMAL_FINISH:
            self.store.record(self)

    def release(self) -> None:
        """The call is over (however it ended); idempotent."""
        self.store.release(self)


class HistoryStore:
    """LRU map of session key to History, bounded by TTL, count and bytes; tracks the calls in flight."""

    def __init__(
        self, config: HistoryConfig, *, max_tokens: int | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        # The per-session token cap; the servicer sets it to the model's context when the config leaves it unset.
        self.max_tokens = config.max_tokens if config.max_tokens is not None else max_tokens
        self._clock = clock
        self._histories: OrderedDict[str, History] = OrderedDict()
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._in_flight: dict[str, list[Turn]] = {}
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._histories)

    @property
    def nbytes(self) -> int:
        """Bytes the held histories are charged (tokens at their array size, messages at their UTF-8 size)."""
        return self._nbytes

    def get(self, key: str) -> History | None:
        """The session's history, without touching its LRU position."""
        self.expire()
        return self._histories.get(key)

    def start(self, key: str, request_id: str, *, continues: bool) -> Turn:
        """Begin a call on the session. Continuing needs a history and no other continuing call in flight."""
        self.expire()
        turns = self._in_flight.setdefault(key, [])
        held = None
        if continues:
            busy = next((t for t in turns if t.continues), None)
            if busy is not None:
                raise HistoryBusy(key, busy.request_id)
            held = self._histories.get(key)
            if held is None:
                if not turns:
                    del self._in_flight[key]
                raise NoHistory(key, self._ended.get(key))
            self._touch(key, held)
        turn = Turn(self, key, request_id, held)
        turns.append(turn)
        return turn

    def continue_chat(self, turn: Turn, new: Sequence[Message]) -> list[Message]:
        """The whole conversation a continuing chat call renders: held messages (answer included), then `new`."""
        held = self._held(turn)
        if held.kind is not HistoryInput.CHAT:
            raise InvalidRequest(
                "chat", f"session {turn.key!r} holds a text/token_ids history: continue it with text or token_ids"
            )
        return [*held.messages, *new]

    def continue_tokens(self, turn: Turn, new: Sequence[int], field_name: str) -> list[int]:
        """The held token ids followed by `new` (the new text's or token ids' ids)."""
        held = self._held(turn)
        if held.kind is not HistoryInput.TOKENS:
            raise InvalidRequest(field_name, f"session {turn.key!r} holds a chat history: continue it with chat")
        return [*held.token_ids, *new]

    def check_length(self, num_tokens: int) -> None:
        """Refuse a continued prompt longer than the per-session token cap."""
        if self.max_tokens is not None and num_tokens > self.max_tokens:
            raise InvalidRequest(
                "continue_session",
                f"the conversation would be {num_tokens} tokens, over the server's --max-session-tokens "
                f"({self.max_tokens}); start a new session with a shorter history",
            )

    def record(self, turn: Turn) -> None:
        """Make the finished turn's conversation the session's history (the last call to finish wins)."""
        if turn.done or turn.kind is None:
            return
        turn.done = True
        if turn.dropped:
            return
        token_ids = array("i", turn.prompt_ids)
        token_ids.extend(turn.answer_ids)
        if turn.kind is HistoryInput.CHAT:
            messages = (*turn.messages, ("assistant", "".join(turn.answer_text)))
            turns = sum(1 for role, _ in messages if role == "assistant")
        else:
            messages = ()
            turns = turn.held.turns + 1 if turn.held is not None else 1
        self._remove(turn.key)
        if self.max_tokens is not None and len(token_ids) >= self.max_tokens:
            self._end(turn.key, f"it ended when it reached the server's --max-session-tokens ({self.max_tokens})")
            return
        history = History(turn.kind, token_ids, messages, turns, self._clock(), time.time())
        self._histories[turn.key] = history
        self._nbytes += history.nbytes
        self._ended.pop(turn.key, None)
        self._enforce_limits(keep=turn.key)

    def release(self, turn: Turn) -> None:
        turns = self._in_flight.get(turn.key)
        if turns is not None and turn in turns:
            turns.remove(turn)
            if not turns:
                del self._in_flight[turn.key]

    def delete(self, key: str) -> bool:
        """Drop the session's history now; calls on it still in flight will write none. Whether it existed."""
        for turn in self._in_flight.get(key, ()):
            turn.dropped = True
        existed = self._remove(key)
        self._end(key, "it was deleted (DeleteSession)")
        return existed

    def expire(self) -> int:
        """Drop histories idle for longer than the TTL; returns how many."""
        deadline = self._clock() - self.config.ttl_s
        expired = 0
        while self._histories:
            key, oldest = next(iter(self._histories.items()))
            if oldest.last_used > deadline:
                break
            self._remove(key)
            self._end(key, f"it expired after {self.config.ttl_s:g} s idle (the server's --session-ttl)")
            expired += 1
        return expired

    # -- helpers ---------------------------------------------------------------------------------

    def _held(self, turn: Turn) -> History:
        if turn.held is None:
            raise ValueError("the turn does not continue a history")
        return turn.held

    def _touch(self, key: str, history: History) -> None:
        history.last_used = self._clock()
        history.last_used_wall = time.time()
        self._histories.move_to_end(key)

    def _remove(self, key: str) -> bool:
        history = self._histories.pop(key, None)
        if history is None:
            return False
        self._nbytes -= history.nbytes
        return True

    def _end(self, key: str, reason: str) -> None:
        self._ended[key] = reason
        self._ended.move_to_end(key)
        while len(self._ended) > MAX_TOMBSTONES:
            self._ended.popitem(last=False)

    def _enforce_limits(self, keep: str) -> None:
        """Evict least recently used histories past max_sessions or the memory cap; `keep` only if alone."""
        cfg = self.config
        while len(self._histories) > cfg.max_sessions or self._nbytes > cfg.max_bytes:
            over_count = len(self._histories) > cfg.max_sessions
            victim = next(iter(self._histories))
            if victim == keep and len(self._histories) > 1:
                self._histories.move_to_end(victim)
                continue
            self._remove(victim)
            if over_count:
                self._end(victim, f"it was evicted: the server holds at most {cfg.max_sessions} (--max-sessions)")
            else:
                mib = cfg.max_bytes / (1 << 20)
                self._end(victim, f"it was evicted: histories are capped at {mib:g} MiB (--session-history-mib)")
