"""The in-process history store (`--history-store memory`): an LRU map of session key to History.

Histories live as long as the process. The store is bounded by the TTL, `max_sessions`, the byte cap (least
recently used first) and the per-session token cap; a bounded list of why recent histories ended lets a
NOT_FOUND say so. Every operation is synchronous book-keeping over Python values under the async interface:
one continuing call per session is the in-flight list of this one process.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from llmserve.history.config import MAX_TOMBSTONES, HistoryConfig
from llmserve.history.errors import HistoryBusy, NoHistory
from llmserve.history.reasons import reason_bytes, reason_count, reason_deleted, reason_ttl
from llmserve.history.records import History, Turn
from llmserve.history.store import HistoryStore


class MemoryHistoryStore(HistoryStore):
    """LRU map of session key to History, bounded by TTL, count and bytes; tracks the calls in flight."""

    kind = "memory"

    def __init__(self, config: HistoryConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config)
        self._clock = clock
        self._histories: OrderedDict[str, History] = OrderedDict()
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._in_flight: dict[str, list[Turn]] = {}
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._histories)

    @property
    def nbytes(self) -> int:
        """Bytes the held histories are charged (see records.footprint)."""
        return self._nbytes

    async def get(self, key: str) -> History | None:
        with self.timed("get"):
            self.expire()
            return self._histories.get(key)

    async def start(self, key: str, request_id: str, *, continues: bool) -> Turn:
        with self.timed("start"):
            return self._start(key, request_id, continues)

    def _start(self, key: str, request_id: str, continues: bool) -> Turn:
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

    async def commit(self, turn: Turn) -> None:
        with self.timed("commit"):
            self._record(turn)

    async def release(self, turn: Turn) -> None:
        turns = self._in_flight.get(turn.key)
        if turns is not None and turn in turns:
            turns.remove(turn)
            if not turns:
                del self._in_flight[turn.key]

    async def delete(self, key: str) -> bool:
        with self.timed("delete"):
            return self._delete(key)

    def _delete(self, key: str) -> bool:
        for turn in self._in_flight.get(key, ()):
            turn.dropped = True
        existed = self._remove(key)
        self._end(key, reason_deleted())
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
            self._end(key, reason_ttl(self.config.ttl_s))
            expired += 1
        return expired

    # -- helpers ---------------------------------------------------------------------------------

    def _record(self, turn: Turn) -> None:
        if turn.dropped:
            return
        finished = turn.finished()
        self._remove(turn.key)
        if finished.end_reason is not None:
            self._end(turn.key, finished.end_reason)
            return
        history = History(
            finished.kind, finished.token_ids, finished.messages, finished.turns, self._clock(), time.time()
        )
        self._histories[turn.key] = history
        self._nbytes += history.nbytes
        self._ended.pop(turn.key, None)
        self._enforce_limits(keep=turn.key)

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
        """Evict least recently used histories past max_sessions or the byte cap; `keep` only if alone."""
        cfg = self.config
        while len(self._histories) > cfg.max_sessions or self._nbytes > cfg.max_bytes:
            over_count = len(self._histories) > cfg.max_sessions
            victim = next(iter(self._histories))
            if victim == keep and len(self._histories) > 1:
                self._histories.move_to_end(victim)
                continue
            self._remove(victim)
            self._end(victim, reason_count(cfg.max_sessions) if over_count else reason_bytes(cfg.max_bytes))
