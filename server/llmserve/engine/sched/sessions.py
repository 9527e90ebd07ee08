"""Session id -> the KV blocks of that conversation so far, held in the shared block pool.

A session holds one reference on each of its blocks, so its KV survives between calls. Sessions are
evicted least recently used first: when running requests need blocks, when there are more than
`max_sessions`, when they hold more than their share of the pool, or when idle past the TTL.

With KV tiers (the pool tracks its evictions), the store remembers the prefix digests of the sessions it
evicted, up to `max_sessions` of them, so that GetSession can say how much of one a lower tier still holds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmserve.engine.sched.block_pool import BlockHash, BlockPool
from llmserve.engine.types.protocol import SessionInfo


class TierWhere(Protocol):
    """What the session store asks of the KV tiers below the pool (kv_tiers/worker.KVTiers): how many tokens of a
    chain of full blocks the pool holds from its first block on, and how many the tiers hold after those."""

    def where(self, block_hashes: Sequence[BlockHash], pool: BlockPool) -> tuple[int, int]: ...


@dataclass(slots=True)
class Session:
    """The tokens whose KV the session's blocks hold, in order; len(blocks) == blocks_for(len(token_ids)). `root`:
    the prefix hash chain's root they were computed under (block_pool.prefix_root of the cache salt, with the LoRA
    adapter's digest: lora/cache_keys.py); a request under another root matches none of them."""

    session_id: str
    token_ids: list[int]
    blocks: list[int]
    last_used: float
    last_used_wall: float
    root: bytes = b""


class SessionStore:
    """LRU map of session id to retained blocks. Pure book-keeping over a BlockPool."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        ttl_s: float,
        max_sessions: int,
        max_pool_fraction: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._ttl_s = ttl_s
        self._max_sessions = max_sessions
        self._max_blocks = int(pool.num_blocks * max_pool_fraction)
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._num_blocks_held = 0
        # Sessions dropped by the store itself (not by delete()), by why: for the metrics.
        self.evictions = {"memory": 0, "limit": 0, "ttl": 0}
        # Evicted session id -> (the digests of its full blocks, its last use in unix time); kept with tiers only.
        self.departed: OrderedDict[str, tuple[list[bytes], float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def num_blocks_held(self) -> int:
        return self._num_blocks_held

    def get(self, session_id: str) -> Session | None:
        """The session without touching its LRU position."""
        return self._sessions.get(session_id)

    def info(self, session_id: str, tiers: TierWhere | None) -> SessionInfo | None:
        """What is held for a session (commands.GetSession): its state, or for one the pool evicted, what is left
        of it in the pool and in the tiers; None when nothing is."""
        self.expire()
        session = self.get(session_id)
        if session is not None:
            return SessionInfo(session_id, len(session.token_ids), session.last_used_wall)
        departed = self.departed.get(session_id)
        if departed is None or tiers is None:
            return None
        in_pool, in_tiers = tiers.where(departed[0], self._pool)
        return SessionInfo(session_id, in_pool, departed[1], in_tiers) if in_pool or in_tiers else None

    def match(self, session_id: str, token_ids: Sequence[int], root: bytes) -> tuple[int, list[int]]:
        """Longest common prefix of `token_ids` with the session's tokens, and the blocks that hold it; nothing
        when the session's KV was computed under another `root` (another LoRA adapter, or none: its KV is not
        this request's).

        Marks the session as used. The caller must acquire() the returned blocks before anything else
        touches the pool; the last block may be only partly covered by the prefix.
        """
        session = self._sessions.get(session_id)
        if session is None:
            return 0, []
        self._touch(session)
        n = self.covered(session_id, token_ids, root)
        return n, session.blocks[: self._pool.blocks_for(n)]

    def covered(self, session_id: str, token_ids: Sequence[int], root: bytes) -> int:
        """How many of `token_ids` the session's KV holds (their longest common prefix; 0 under another `root`),
        without touching it."""
        session = self._sessions.get(session_id)
        if session is None or session.root != root:
            return 0
        cached = session.token_ids
        limit = min(len(cached), len(token_ids))
        n = 0
        while n < limit and cached[n] == token_ids[n]:
            n += 1
        return n

    def retain(self, session_id: str, token_ids: list[int], blocks: list[int], root: bytes) -> None:
        """Make the session hold `blocks` (whose references the caller hands over) for `token_ids`, computed under
        the prefix hash chain's `root` (what `match` checks).

        Replaces whatever the session held before: the last call to finish wins.
        """
        if len(blocks) != self._pool.blocks_for(len(token_ids)):
            raise ValueError("blocks do not match the token count")
        self.delete(session_id)
        self.departed.pop(session_id, None)
        now = self._clock()
        session = Session(session_id, token_ids, blocks, now, time.time(), root)
        self._sessions[session_id] = session
        self._num_blocks_held += len(blocks)
        self.enforce_limits(keep=session_id)

    def delete(self, session_id: str) -> bool:
        """Free the session's references now. Returns whether it existed."""
        self.departed.pop(session_id, None)
        return self._drop(session_id)

    def _evict(self, session_id: str) -> None:
        """Drop a session for the store's own reasons; with tiers, remember where its KV may still be."""
        session = self._sessions.get(session_id)
        if session is not None and self._pool.track_evictions:
            hashes = [h for h in (self._pool.block_hash[b] for b in session.blocks) if h is not None]
            self.departed[session_id] = (hashes, session.last_used_wall)
            while len(self.departed) > self._max_sessions:
                self.departed.popitem(last=False)
        self._drop(session_id)

    def _drop(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._num_blocks_held -= len(session.blocks)
        self._pool.release(session.blocks)
        return True

    def evict_one(self) -> bool:
        """Drop the least recently used session; False if there is none."""
        if not self._sessions:
            return False
        self._evict(next(iter(self._sessions)))
        self.evictions["memory"] += 1
        return True

    def evict_until_free(self, num_blocks: int) -> bool:
        """Evict LRU sessions until the pool can allocate `num_blocks`; True if it now can."""
        while not self._pool.can_allocate(num_blocks):
            if not self.evict_one():
                return False
        return True

    def expire(self) -> int:
        """Drop sessions idle for longer than the TTL; returns how many."""
        deadline = self._clock() - self._ttl_s
        expired = 0
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest.last_used > deadline:
                break
            self._evict(oldest.session_id)
            expired += 1
        self.evictions["ttl"] += expired
        return expired

    def enforce_limits(self, keep: str | None = None) -> None:
        """Evict LRU sessions past max_sessions or the pool share, never the one named `keep`."""
        while len(self._sessions) > self._max_sessions or self._num_blocks_held > self._max_blocks:
            victim = next(iter(self._sessions))
            if victim == keep:
                if len(self._sessions) == 1:
                    # The only session is over the share on its own: drop it rather than hold the pool.
                    self._evict(victim)
                    self.evictions["limit"] += 1
                    return
                self._sessions.move_to_end(victim)
                continue
            self._evict(victim)
            self.evictions["limit"] += 1

    def _touch(self, session: Session) -> None:
        session.last_used = self._clock()
        session.last_used_wall = time.time()
        self._sessions.move_to_end(session.session_id)
