"""The host-memory tier: evicted blocks' KV kept in host tensors (pinned memory when the cache is on CUDA).

On the CPU backend the pool itself lives in host memory, so this tier only moves KV from one part of the same
memory to another: there the disk tier is the one that pays. On CUDA it is the cheap tier: a reload is a
host-to-device copy of a block instead of a prefill.
"""

from __future__ import annotations

import threading

from llmserve.engine.backends.base import BlockData
from llmserve.engine.kv_tiers.index import TierIndex
from llmserve.engine.sched.block_pool import BlockContent, BlockHash


class HostTier:
    """At most `capacity_bytes` of block payloads, least recently used evicted first. Thread-safe."""

    name = "host"

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.index = TierIndex(capacity_bytes, block_bytes)
        self._data: dict[BlockHash, BlockData] = {}
        self._lock = threading.Lock()

    def put(self, content: BlockContent, data: BlockData) -> None:
        with self._lock:
            self._data[content.block_hash] = data
            for gone in self.index.add(content):
                self._data.pop(gone, None)
        self.index.counters.stored_blocks += 1
        self.index.counters.stored_bytes += self.index.block_bytes

    def get(self, content: BlockContent) -> BlockData | None:
        """The block's KV if this tier holds exactly that content: its digest, parent and tokens (None otherwise:
        the caller tries the next tier, or counts a failed load)."""
        with self._lock:
            data = self._data.get(content.block_hash)
            if data is None or self.index.get(content.block_hash) != content:
                return None
        self.index.counters.loaded_blocks += 1
        self.index.counters.loaded_bytes += self.index.block_bytes
        return data
