"""The books of one lower KV tier: which block digests it holds, for which content, least recently used first.

Pure Python and thread-safe (the step thread asks `has`, the tier worker adds and drops entries). An entry is
keyed by the block's prefix digest (block_pool.chain_hash) and records the parent digest and tokens it was
stored for; `has` and `take` compare them, so a digest that matched by collision is a miss, and since the salt
is the root of every chain, one identity's KV is never served to another.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from llmserve.engine.sched.block_pool import BlockContent, BlockHash
from llmserve.engine.types.stats import TierCounters


class TierIndex:
    """LRU index of one tier, bounded to `capacity_bytes` of payload. Every method takes the index's lock."""

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        if block_bytes < 1 or capacity_bytes < block_bytes:
            raise ValueError(f"a tier of {capacity_bytes} bytes holds no block of {block_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_bytes // block_bytes
        self._entries: OrderedDict[BlockHash, BlockContent] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def has(self, block_hash: BlockHash, parent: BlockHash, tokens: Sequence[int]) -> bool:
        """Whether this tier holds the block for exactly this parent and tokens (counted as a hit or a miss)."""
        with self._lock:
            entry = self._entries.get(block_hash)
            hit = entry is not None and entry.parent == parent and entry.tokens == tuple(tokens)
            if hit:
                self._entries.move_to_end(block_hash)
                self.counters.hits += 1
            else:
                self.counters.misses += 1
            return hit

    def get(self, block_hash: BlockHash) -> BlockContent | None:
        with self._lock:
            return self._entries.get(block_hash)

    def add(self, content: BlockContent) -> list[BlockHash]:
        """Record a stored block as the most recently used; returns the digests evicted to make room (oldest
        first), whose payload the caller drops."""
        with self._lock:
            self._entries[content.block_hash] = content
            self._entries.move_to_end(content.block_hash)
            evicted = []
            while len(self._entries) > self.capacity_blocks:
                victim, _ = self._entries.popitem(last=False)
                evicted.append(victim)
            self.counters.evicted_blocks += len(evicted)
            return evicted

    def remove(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return self._entries.pop(block_hash, None) is not None
