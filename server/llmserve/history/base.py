"""What every history store shares: the types, a call's `Turn`, and the `HistoryStore` contract.

A store maps a session key to the conversation held for it (`History`). Three implementations keep the same
contract (memory.py; sqlite_store.py and redis_store.py, with the leases of lease.py); the servicer only ever
sees this interface and translates `NoHistory`, `HistoryBusy`, `LeaseLost` and `StoreUnavailable` into status codes.

What a commit is: a turn that finished normally is written in one atomic store operation (one SQLite
transaction, one Redis script) *before* the call's last message is sent. A crash before that operation loses
that turn only; an earlier turn is never lost and a turn is never half written. A commit that fails fails the
call (UNAVAILABLE), so a caller that got its last message knows the turn is held.

One continuing call per session: a continuing call holds the session's lease from `start()` to its commit or
release. Stores shared by several processes expire a lease after `lease_s` unless its holder renews it (every
third of that while the call runs), so a crashed holder locks a session for at most `lease_s`; a commit checks
in the same operation that the lease is still its own (a holder paused past its lease writes nothing).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
import sys
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from llmserve.engine.delta import Delta, FinishReason
from llmserve.engine.errors import InvalidRequest

log = logging.getLogger("llmserve.history")

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
# How many ended histories remember why they ended (for the NOT_FOUND message); Redis keeps them a day instead.
MAX_TOMBSTONES = 4096
# Upper bounds of the store latency histogram's buckets (seconds): a memory store answers in microseconds,
# SQLite and a loopback Redis in well under a millisecond, a remote or struggling store in many.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

Message = tuple[str, str]  # (role, content)


class HistoryInput(enum.Enum):
    """The kind of input a history was built from, and so the kind that may continue it."""

    CHAT = "chat"
    TOKENS = "tokens"  # text or token ids


@dataclass(slots=True, frozen=True)
class HistoryConfig:
    """Limits of the history store and where it lives. `max_tokens` None: the model's context length.

    `store`: "memory", "sqlite:PATH" or "redis://HOST:PORT/DB"; None: memory for a server built in-process,
    `sqlite:<cache dir>/sessions.sqlite3` for `python -m llmserve` (config.from_args fills it in).
    `optional`: a store unreachable at start leaves the server serving stateless calls (calls with a session id
    fail UNAVAILABLE until it answers).
    `lease_s`: how long a continuing call's lease outlives its holder's last renewal (shared stores).
    """

    ttl_s: float = 600.0
    max_sessions: int = 4096
    max_bytes: int = 256 << 20
    max_tokens: int | None = None
    store: str | None = None
    optional: bool = False
    lease_s: float = 10.0


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


class LeaseLost(RuntimeError):
    """A continuing call's lease expired and another call took the session: its turn was not written."""

    def __init__(self, key: str) -> None:
        super().__init__(f"session {key!r}: the call's lease expired and another call continued the session")
        self.key = key


class StoreUnavailable(RuntimeError):
    """The history store did not answer, or answered with an error; `store` names it (no secrets)."""

    def __init__(self, store: str, reason: str) -> None:
        super().__init__(f"the session history store {store} is unavailable: {reason}")
        self.store = store
        self.reason = reason


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


def ids_to_bytes(token_ids: array[int]) -> bytes:
    """Token ids as little-endian int32 (the durable stores' encoding)."""
    if token_ids.itemsize != 4:
        token_ids = array("i", token_ids)
    if sys.byteorder == "big":
        token_ids = array("i", token_ids)
        token_ids.byteswap()
    return token_ids.tobytes()


def ids_from_bytes(data: bytes) -> array[int]:
    ids = array("i")
    ids.frombytes(data)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


@dataclass(slots=True, frozen=True)
class Finished:
    """What a finished turn leaves behind, composed from its prompt and answer."""

    kind: HistoryInput
    token_ids: array[int]
    messages: tuple[Message, ...]
    turns: int


@dataclass(slots=True, eq=False)
class Turn:
    """One call with a session id, from its start to its end; it writes the history when it finishes normally.

    `held` is the history a continuing call read; `epoch` counts the session's deletions as `start()` saw
    them (a turn that finishes after a deletion writes nothing); `lease` the continuing call's lease token.
    `begin()` tells what the call sends to the engine; `observe()` collects the answer from the engine's
    deltas and commits the history before the final delta goes out.
    """

    store: HistoryStore
    key: str
    request_id: str
    held: History | None
    epoch: int = 0
    lease: str | None = None
    kind: HistoryInput | None = None
    prompt_ids: list[int] = field(default_factory=list)
    messages: tuple[Message, ...] = ()
    answer_ids: list[int] = field(default_factory=list)
    answer_text: list[str] = field(default_factory=list)
    dropped: bool = False  # the session was deleted meanwhile: write nothing
    done: bool = False
    renewal: asyncio.Task[None] | None = None

    @property
    def continues(self) -> bool:
        return self.held is not None

    def begin(self, kind: HistoryInput, prompt_ids: Sequence[int], messages: Sequence[Message] = ()) -> None:
        self.kind = kind
        self.prompt_ids = list(prompt_ids)
        self.messages = tuple(messages)

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
        return Finished(self.kind, token_ids, messages, turns)

    async def release(self) -> None:
        """The call is over (however it ended); idempotent, never raises."""
        await self.store.release(self)


@dataclass(slots=True)
class OpStats:
    """Latency buckets (cumulative at scrape time), their sum and count, and errors of one store operation."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total_s: float = 0.0
    count: int = 0
    errors: int = 0

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(LATENCY_BUCKETS) if seconds <= bound), len(LATENCY_BUCKETS))
        self.buckets[index] += 1
        self.total_s += seconds
        self.count += 1


# -- the reasons a NOT_FOUND quotes ---------------------------------------------------------------------------


def reason_ttl(ttl_s: float) -> str:
    return f"it expired after {ttl_s:g} s idle (the server's --session-ttl)"


def reason_deleted() -> str:
    return "it was deleted (DeleteSession)"


def reason_tokens(max_tokens: int) -> str:
    return f"it ended when it reached the server's --max-session-tokens ({max_tokens})"


def reason_count(max_sessions: int) -> str:
    return f"it was evicted: the server holds at most {max_sessions} (--max-sessions)"


def reason_bytes(max_bytes: int) -> str:
    return f"it was evicted: histories are capped at {max_bytes / (1 << 20):g} MiB (--session-history-mib)"


class HistoryStore(abc.ABC):
    """The contract of a history store; `kind` names the implementation (a metrics label), `name` the store
    itself in error messages (a path or a URL without credentials)."""

    kind = "abstract"

    def __init__(self, config: HistoryConfig, *, max_tokens: int | None = None) -> None:
        self.config = config
        # The per-session token cap; the servicer sets it to the model's context when the config leaves it unset.
        self.max_tokens = config.max_tokens if config.max_tokens is not None else max_tokens
        self.name = self.kind
        self.stats: dict[str, OpStats] = {}

    async def connect(self) -> None:  # noqa: B027 - a store without a connection has nothing to open
        """Open the store and check that it answers; raises StoreUnavailable with the reason."""

    async def close(self) -> None:  # noqa: B027 - nor anything to close
        """Release connections and threads; calls after it fail."""

    @abc.abstractmethod
    async def get(self, key: str) -> History | None:
        """The session's history, without touching its LRU position or TTL."""

    @abc.abstractmethod
    async def start(self, key: str, request_id: str, *, continues: bool) -> Turn:
        """Begin a call on the session. Continuing needs a history (else NoHistory) and no other continuing
        call holding the session (else HistoryBusy); it refreshes the history's TTL and LRU position."""

    @abc.abstractmethod
    async def commit(self, turn: Turn) -> None:
        """Atomically make the finished turn's conversation the session's history (the last call to finish
        wins) and free its lease; nothing when the session was deleted since the turn started. Raises
        LeaseLost when another call took the session, StoreUnavailable when the store failed (nothing written)."""

    @abc.abstractmethod
    async def release(self, turn: Turn) -> None:
        """The call is over: free its lease if it still holds one. Idempotent; logs store errors, never raises."""

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Drop the session's history now; calls on it still in flight will write none. Whether it existed."""

    # -- shared, store-independent -------------------------------------------------------------------------

    def continue_chat(self, turn: Turn, new: Sequence[Message]) -> list[Message]:
        """The whole conversation a continuing chat call renders: held messages (answer included), then `new`."""
        held = _held(turn)
        if held.kind is not HistoryInput.CHAT:
            raise InvalidRequest(
                "chat", f"session {turn.key!r} holds a text/token_ids history: continue it with text or token_ids"
            )
        return [*held.messages, *new]

    def continue_tokens(self, turn: Turn, new: Sequence[int], field_name: str) -> list[int]:
        """The held token ids followed by `new` (the new text's or token ids' ids)."""
        held = _held(turn)
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

    def ends_at_cap(self, finished: Finished) -> str | None:
        """The reason a finished turn ends its history instead of being held (it reached the token cap)."""
        if self.max_tokens is not None and len(finished.token_ids) >= self.max_tokens:
            return reason_tokens(self.max_tokens)
        return None

    @contextlib.contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """Count one store operation's latency, and an error when it raises StoreUnavailable."""
        stats = self.stats.get(op)
        if stats is None:
            stats = self.stats[op] = OpStats()
        began = time.perf_counter()
        try:
            yield
        except StoreUnavailable:
            stats.errors += 1
            raise
        finally:
            stats.observe(time.perf_counter() - began)


def _held(turn: Turn) -> History:
    if turn.held is None:
        raise ValueError("the turn does not continue a history")
    return turn.held
