"""The contract every history store keeps (`HistoryStore`), and what they share: the timing of their operations.

A store maps a session key to the conversation held for it (`History`, records.py). Three implementations keep
the same contract (memory.py; sqlite_store.py and redis_store.py, with the leases of lease.py); the servicer only
ever sees this interface and translates `NoHistory`, `HistoryBusy`, `LeaseLost` and `StoreUnavailable`
(errors.py) into status codes. How a continuing call's prompt is composed from what a store holds, and the
per-session token cap, are api/prompts.py's.

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
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from llmserve.engine.types.stats import LatencyHistogram
from llmserve.history.config import HistoryConfig
from llmserve.history.errors import StoreUnavailable
from llmserve.history.records import History, Turn

log = logging.getLogger("llmserve.history")

# Upper bounds of the store latency histogram's buckets (seconds): a memory store answers in microseconds,
# SQLite and a loopback Redis in well under a millisecond, a remote or struggling store in many.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class OpStats:
    """One store operation's latency and its failures, read by the metrics when scraped."""

    latency: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(LATENCY_BUCKETS))
    errors: int = 0


class HistoryStore(abc.ABC):
    """The contract of a history store; `kind` names the implementation (a metrics label), `name` the store
    itself in error messages (a path or a URL without credentials)."""

    kind = "abstract"

    def __init__(self, config: HistoryConfig) -> None:
        self.config = config
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
        wins; one that reached the token cap ends it instead, with its `end_reason`) and free its lease; nothing
        when the session was deleted since the turn started. Raises
        LeaseLost when another call took the session, StoreUnavailable when the store failed (nothing written)."""

    @abc.abstractmethod
    async def release(self, turn: Turn) -> None:
        """The call is over: free its lease if it still holds one. Idempotent; logs store errors, never raises."""

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Drop the session's history now; calls on it still in flight will write none. Whether it existed."""

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
            stats.latency.observe(time.perf_counter() - began)
