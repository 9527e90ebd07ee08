"""The log of what the block pool's prefix cache gained and lost (types/kv_cache.py's events: a block stored, with its
digest, its parent's and its tokens, and a block removed, evicted or forgotten). A gateway that routes on KV (smg's
cache_aware) follows them.

The pool records them into a `KvEventLog` as it changes its books (on the step thread, no lock: appending to and
popping from a deque are atomic); the front end takes them (`take`), on the core's thread or, for an engine
process, with each pass's outputs. The log is bounded: when nobody takes them the oldest are dropped, and the
events' numbers then have a gap, by which the taker knows its view is incomplete. Each event carries the cache
salt its chain was hashed under (UNKNOWN_SALT when the pool cannot tell), so that the front end gives a subscriber
only its own identity's blocks.
"""

from __future__ import annotations

import itertools
from collections import deque

from llmserve.engine.types.kv_cache import KvEvent, KvRemoved, KvStored

DEFAULT_CAPACITY = 8192


class KvEventLog:
    """A bounded, numbered record of the pool's stored and removed blocks, oldest first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._numbers = itertools.count(1)

    def stored(self, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...], salt: str | None) -> None:
        self._events.append(KvStored(next(self._numbers), block_hash, parent, tokens, salt))

    def removed(self, block_hash: bytes, salt: str | None) -> None:
        self._events.append(KvRemoved(next(self._numbers), block_hash, salt))

    def extend(self, events: list[KvEvent]) -> None:
        """Events recorded elsewhere (an engine process's), numbers kept."""
        self._events.extend(events)

    def take(self) -> list[KvEvent]:
        """The events recorded since the last call (from any thread)."""
        out: list[KvEvent] = []
        while True:
            try:
                out.append(self._events.popleft())
            except IndexError:
                return out
