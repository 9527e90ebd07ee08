"""The block pool on its own: ref counts, the free list, the prefix cache and its eviction order, and the checker
that the scheduler's state machine relies on to catch bad books."""

from __future__ import annotations

import pytest

from llmserve.engine.block_pool import BlockPool, NoFreeBlocks, chain_hash


def test_sizes_must_be_positive() -> None:
    for num_blocks, block_size in [(0, 4), (4, 0), (-1, 4)]:
        with pytest.raises(ValueError, match="^num_blocks and block_size must be >= 1$"):
            BlockPool(num_blocks, block_size)
    pool = BlockPool(1, 1)  # the smallest pool there is
    assert (pool.num_blocks, pool.block_size, pool.num_free) == (1, 1, 1)


def test_blocks_for_rounds_up() -> None:
    pool = BlockPool(8, 4)
    assert [pool.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_fresh_blocks_come_out_low_ids_first_with_one_reference() -> None:
    pool = BlockPool(5, 4)
    assert pool.allocate(2) == [0, 1]
    assert pool.ref_count == [1, 1, 0, 0, 0]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free == 0 and not pool.can_allocate(1) and pool.can_allocate(0)
    pool.check([[0, 1], [2, 3, 4]])


def test_allocate_exactly_what_is_free_and_not_one_more() -> None:
    pool = BlockPool(3, 4)
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    with pytest.raises(NoFreeBlocks, match="asked for 4 blocks, 3 free"):
        pool.allocate(4)
    assert pool.num_free == 3  # a refused allocation takes nothing
    assert sorted(pool.allocate(3)) == [0, 1, 2]


def test_release_returns_anonymous_blocks_to_the_free_list_last_freed_first() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(4)
    pool.release([blocks[2]])
    pool.release([blocks[0]])
    assert pool.num_free == 2 and pool.num_cached == 0
    assert pool.ref_count == [0, 1, 0, 1]
    assert pool.allocate(1) == [0]  # the free list is a stack
    pool.check([[0], [1], [3]])


def test_references_count_up_and_down() -> None:
    pool = BlockPool(2, 4)
    (block,) = pool.allocate(1)
    pool.acquire([block])
    pool.acquire([block])
    assert pool.ref_count[block] == 3
    pool.release([block])
    assert pool.ref_count[block] == 2 and pool.num_free == 1
    pool.release([block, block])
    assert pool.ref_count[block] == 0 and pool.num_free == 2
    with pytest.raises(ValueError, match=f"block {block} released more often than acquired"):
        pool.release([block])
    assert pool.ref_count[block] == 0


def test_acquiring_a_free_block_is_refused() -> None:
    pool = BlockPool(2, 4)
    with pytest.raises(ValueError, match="block 1 is free; allocate it instead"):
        pool.acquire([1])
    assert pool.ref_count == [0, 0] and pool.num_free == 2


def test_a_registered_block_is_cached_when_released_and_revived_by_acquire() -> None:
    pool = BlockPool(3, 2)
    h = chain_hash(None, [1, 2])
    (block,) = pool.allocate(1)
    pool.register(block, h)
    assert pool.lookup(h) == block and pool.block_hash[block] == h
    pool.release([block])
    assert pool.num_cached == 1 and pool.num_free == 3 and pool.lookup(h) == block
    pool.check([])
    pool.acquire([block])  # revived: no longer evictable
    assert pool.ref_count[block] == 1 and pool.num_cached == 0 and pool.num_free == 2
    pool.check([[block]])
    assert pool.allocate(2) == [1, 2]  # the revived block is not handed out again
    assert pool.lookup(h) == block


def test_fresh_blocks_are_preferred_to_cached_ones_and_cached_ones_go_least_recently_freed_first() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(3)
    hashes = [chain_hash(None, [i, i]) for i in range(3)]
    for block, h in zip(blocks, hashes, strict=True):
        pool.register(block, h)
    pool.release([blocks[1]])
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    assert pool.num_cached == 3 and pool.num_free == 4
    assert pool.allocate(1) == [3]  # the never-used block first: every cached prefix survives
    assert all(pool.lookup(h) is not None for h in hashes)
    assert pool.allocate(1) == [blocks[1]]  # then the cached block freed first
    assert pool.lookup(hashes[1]) is None and pool.block_hash[blocks[1]] is None
    assert pool.lookup(hashes[0]) == blocks[0] and pool.lookup(hashes[2]) == blocks[2]
    assert pool.allocate(2) == [blocks[0], blocks[2]]
    assert pool.num_cached == 0 and all(pool.lookup(h) is None for h in hashes)
    pool.check([[3], [blocks[1]], [blocks[0]], [blocks[2]]])


def test_reviving_a_cached_block_takes_it_out_of_the_eviction_order() -> None:
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    pool.register(a, 11)
    pool.register(b, 22)
    pool.release([a, b])
    pool.acquire([a])
    pool.release([a])  # freed again: now the most recently freed
    assert pool.allocate(1) == [b]
    assert pool.lookup(11) == a and pool.lookup(22) is None


def test_register_needs_an_owned_block_and_keeps_the_first_copy_of_a_prefix() -> None:
    pool = BlockPool(3, 2)
    with pytest.raises(ValueError, match="block 0 is not owned"):
        pool.register(0, 5)
    a, b = pool.allocate(2)
    pool.register(a, 5)
    pool.register(b, 5)  # the same prefix again: b stays anonymous
    assert pool.lookup(5) == a and pool.block_hash[b] is None
    pool.register(a, 6)  # a block keeps the hash it has
    assert pool.block_hash[a] == 5 and pool.lookup(6) is None
    pool.release([b])
    assert pool.num_cached == 0 and pool.num_free == 2  # anonymous: straight back to the free list
    pool.release([a])
    assert pool.num_cached == 1
    pool.check([])


def test_clear_cache_forgets_every_unreferenced_prefix_in_freeing_order() -> None:
    pool = BlockPool(3, 2)
    a, b, c = pool.allocate(3)
    for block, h in ((a, 1), (b, 2), (c, 3)):
        pool.register(block, h)
    pool.release([b])
    pool.release([a])  # c stays owned
    pool.clear_cache()
    assert pool.num_cached == 0 and pool.num_free == 2
    assert pool.lookup(1) is None and pool.lookup(2) is None and pool.lookup(3) == c
    assert pool.block_hash[a] is None and pool.block_hash[b] is None
    pool.check([[c]])
    assert pool.allocate(2) == [a, b]  # pushed in freeing order, popped from the end: the last freed comes first


def test_chain_hash_depends_on_the_parent_and_every_token() -> None:
    base = chain_hash(None, [1, 2, 3])
    assert base == chain_hash(None, (1, 2, 3))
    assert len({base, chain_hash(7, [1, 2, 3]), chain_hash(None, [1, 2, 4]), chain_hash(None, [1, 2])}) == 4
    assert chain_hash(base, [4]) != chain_hash(chain_hash(None, [1, 2, 4]), [4])


# -- check(): each kind of bad book is reported --------------------------------------------------------------------


def test_check_reports_a_ref_count_that_differs_from_the_owners() -> None:
    pool = BlockPool(12, 2)
    blocks = pool.allocate(12)
    pool.check([blocks])
    with pytest.raises(ValueError, match=r"ref counts differ from owners at blocks \[3\]$"):
        pool.check([blocks[:3] + blocks[4:]])
    with pytest.raises(ValueError, match=r"at blocks \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\]$"):
        pool.check([])  # at most ten listed
    with pytest.raises(ValueError, match="ref counts differ"):
        pool.check([blocks, [5]])


def test_check_reports_a_block_listed_twice() -> None:
    pool = BlockPool(3, 2)
    pool._free.append(0)
    with pytest.raises(ValueError, match="^a block is listed twice among free/cached$"):
        pool.check([])
    pool = BlockPool(3, 2)
    pool._cached[0] = None
    with pytest.raises(ValueError, match="^a block is listed twice among free/cached$"):
        pool.check([])


def test_check_reports_a_lost_block() -> None:
    pool = BlockPool(3, 2)
    pool._free.remove(1)
    with pytest.raises(ValueError, match="^unowned blocks differ from free\\+cached$"):
        pool.check([])


def test_check_reports_a_hash_index_that_disagrees() -> None:
    pool = BlockPool(3, 2)
    (block,) = pool.allocate(1)
    pool.register(block, 9)
    pool._hash_to_block[9] = 2
    with pytest.raises(ValueError, match="hash index disagrees at block 2"):
        pool.check([[block]])


def test_check_reports_a_free_block_with_a_hash() -> None:
    pool = BlockPool(3, 2)
    pool.block_hash[1] = 4
    with pytest.raises(ValueError, match="^a free block still has a hash$"):
        pool.check([])
