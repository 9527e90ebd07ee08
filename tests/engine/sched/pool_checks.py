"""The books' invariants, checked from outside by the tests: a block pool's reference counts, free and cached lists and
hash index against the owners of its blocks (running sequences' tables, sessions' blocks, the blocks waiting
sequences pin while their reloads run). They read the books' private state: no product code needs them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmserve.engine.sched.block_pool import BlockPool
from llmserve.engine.sched.scheduler import Scheduler
from llmserve.engine.sched.sessions import SessionStore


def check_pool(pool: BlockPool, owners: Iterable[Sequence[int]]) -> None:
    """Verify the books against the given owners' block lists (one entry per reference held).

    Raises ValueError on any leak, double free or miscount.
    """
    expected = [0] * pool.num_blocks
    for block in pool._loading:
        expected[block] += 1  # the load's own reference
    for blocks in owners:
        for block in blocks:
            expected[block] += 1
    if expected != pool.ref_count:
        bad = [b for b in range(pool.num_blocks) if expected[b] != pool.ref_count[b]]
        raise ValueError(f"ref counts differ from owners at blocks {bad[:10]}")
    free = set(pool._free)
    cached = set(pool._cached)
    if len(free) != len(pool._free) or free & cached:
        raise ValueError("a block is listed twice among free/cached")
    unowned = {b for b in range(pool.num_blocks) if pool.ref_count[b] == 0}
    if unowned != free | cached:
        raise ValueError("unowned blocks differ from free+cached")
    for block_hash, block in pool._hash_to_block.items():
        if pool.block_hash[block] != block_hash:
            raise ValueError(f"hash index disagrees at block {block}")
    if any(pool.block_hash[b] is not None for b in free):
        raise ValueError("a free block still has a hash")
    if any(pool.block_hash[b] is not None for b in pool._loading):
        raise ValueError("a loading block already has a hash")


def pinned(scheduler: Scheduler) -> list[list[int]]:
    """The blocks waiting sequences hold while their reloads run, for check_pool."""
    return [p.pins for p in scheduler._pending.values()]


def session_owners(sessions: SessionStore) -> list[list[int]]:
    """Every session's block list, for check_pool."""
    return [s.blocks for s in sessions._sessions.values()]
