"""The block pool on its own: ref counts, the free list, the prefix cache and its eviction order, and the checker
that the scheduler's state machine relies on to catch bad books."""

from __future__ import annotations

import pytest

from llmserve.engine.sched.block_pool import BlockPool, NoFreeBlocks, chain_hash, prefix_root
from tests.engine.engine_helpers import clear_cache
from tests.engine.sched.pool_checks import check_pool


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
    check_pool(pool, [[0, 1], [2, 3, 4]])


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
    check_pool(pool, [[0], [1], [3]])


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


def put(pool: BlockPool, block: int, tokens: list[int], parent: bytes | None = None) -> bytes:
    """Register `block` as holding `tokens` after `parent`; its hash."""
    h = chain_hash(parent, tokens)
    pool.register(block, h, parent, tokens)
    return h


def find(pool: BlockPool, tokens: list[int], parent: bytes | None = None) -> int | None:
    return pool.lookup(chain_hash(parent, tokens), parent, tokens)


def test_a_registered_block_is_cached_when_released_and_revived_by_acquire() -> None:
    pool = BlockPool(3, 2)
    (block,) = pool.allocate(1)
    h = put(pool, block, [1, 2])
    assert find(pool, [1, 2]) == block and pool.block_hash[block] == h
    pool.release([block])
    assert pool.num_cached == 1 and pool.num_free == 3 and find(pool, [1, 2]) == block
    check_pool(pool, [])
    pool.acquire([block])  # revived: no longer evictable
    assert pool.ref_count[block] == 1 and pool.num_cached == 0 and pool.num_free == 2
    check_pool(pool, [[block]])
    assert pool.allocate(2) == [1, 2]  # the revived block is not handed out again
    assert find(pool, [1, 2]) == block


def test_fresh_blocks_are_preferred_to_cached_ones_and_cached_ones_go_least_recently_freed_first() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(3)
    contents = [[i, i] for i in range(3)]
    for block, tokens in zip(blocks, contents, strict=True):
        put(pool, block, tokens)
    pool.release([blocks[1]])
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    assert pool.num_cached == 3 and pool.num_free == 4
    assert pool.allocate(1) == [3]  # the never-used block first: every cached prefix survives
    assert all(find(pool, tokens) is not None for tokens in contents)
    assert pool.allocate(1) == [blocks[1]]  # then the cached block freed first
    assert find(pool, contents[1]) is None and pool.block_hash[blocks[1]] is None
    assert find(pool, contents[0]) == blocks[0] and find(pool, contents[2]) == blocks[2]
    assert pool.allocate(2) == [blocks[0], blocks[2]]
    assert pool.num_cached == 0 and all(find(pool, tokens) is None for tokens in contents)
    check_pool(pool, [[3], [blocks[1]], [blocks[0]], [blocks[2]]])


def test_reviving_a_cached_block_takes_it_out_of_the_eviction_order() -> None:
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    put(pool, a, [1, 1])
    put(pool, b, [2, 2])
    pool.release([a, b])
    pool.acquire([a])
    pool.release([a])  # freed again: now the most recently freed
    assert pool.allocate(1) == [b]
    assert find(pool, [1, 1]) == a and find(pool, [2, 2]) is None


def test_register_needs_an_owned_block_and_keeps_the_first_copy_of_a_prefix() -> None:
    pool = BlockPool(3, 2)
    with pytest.raises(ValueError, match="block 0 is not owned"):
        put(pool, 0, [5, 5])
    a, b = pool.allocate(2)
    h = put(pool, a, [5, 5])
    put(pool, b, [5, 5])  # the same prefix again: b stays anonymous
    assert find(pool, [5, 5]) == a and pool.block_hash[b] is None
    put(pool, a, [6, 6])  # a block keeps the hash it has
    assert pool.block_hash[a] == h and find(pool, [6, 6]) is None
    pool.release([b])
    assert pool.num_cached == 0 and pool.num_free == 2  # anonymous: straight back to the free list
    pool.release([a])
    assert pool.num_cached == 1
    check_pool(pool, [])


def test_allocating_every_unreferenced_block_forgets_every_cached_prefix_in_freeing_order() -> None:
    """What the tests' clear_cache does: allocate() evicts the cached blocks oldest first; released, they are free."""
    pool = BlockPool(3, 2)
    a, b, c = pool.allocate(3)
    for block, token in ((a, 1), (b, 2), (c, 3)):
        put(pool, block, [token, token])
    pool.release([b])
    pool.release([a])  # c stays owned
    clear_cache(pool)
    assert pool.num_cached == 0 and pool.num_free == 2
    assert find(pool, [1, 1]) is None and find(pool, [2, 2]) is None and find(pool, [3, 3]) == c
    assert pool.block_hash[a] is None and pool.block_hash[b] is None
    check_pool(pool, [[c]])
    assert pool.allocate(2) == [a, b]  # pushed in freeing order, popped from the end: the last freed comes first


def test_chain_hash_depends_on_the_parent_and_every_token() -> None:
    base = chain_hash(None, [1, 2, 3])
    assert base == chain_hash(None, (1, 2, 3)) and len(base) == 16
    other_root = prefix_root("tenant-a")
    assert chain_hash(None, [1]) == chain_hash(prefix_root(None), [1])
    assert len({base, chain_hash(other_root, [1, 2, 3]), chain_hash(None, [1, 2, 4]), chain_hash(None, [1, 2])}) == 4
    assert chain_hash(base, [4]) != chain_hash(chain_hash(None, [1, 2, 4]), [4])
    # Fixed-width tokens: a split of the same digits is another block, and so are large ids.
    assert chain_hash(None, [12, 3]) != chain_hash(None, [1, 23])
    assert chain_hash(None, [2**40]) != chain_hash(None, [0])
    assert prefix_root("a") != prefix_root("b") != prefix_root(None)


def test_a_hit_is_checked_against_the_blocks_parent_and_tokens() -> None:
    # A digest that matches by collision (planted here: the index itself cannot be made to collide) is a miss,
    # never another prompt's KV.
    pool = BlockPool(2, 2)
    (block,) = pool.allocate(1)
    h = put(pool, block, [1, 2])
    assert pool.lookup(h, None, [1, 2]) == block and pool.num_hash_mismatches == 0
    assert pool.lookup(h, None, [1, 3]) is None
    assert pool.lookup(h, prefix_root("someone else"), [1, 2]) is None
    assert pool.num_hash_mismatches == 2
    pool.release([block])
    pool.allocate(2)  # evicted: its content is forgotten with its hash
    assert pool.lookup(h, None, [1, 2]) is None and pool.num_hash_mismatches == 2


# -- check(): each kind of bad book is reported --------------------------------------------------------------------


def test_check_reports_a_ref_count_that_differs_from_the_owners() -> None:
    pool = BlockPool(12, 2)
    blocks = pool.allocate(12)
    check_pool(pool, [blocks])
    with pytest.raises(ValueError, match=r"ref counts differ from owners at blocks \[3\]$"):
        check_pool(pool, [blocks[:3] + blocks[4:]])
    with pytest.raises(ValueError, match=r"at blocks \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\]$"):
        check_pool(pool, [])  # at most ten listed
    with pytest.raises(ValueError, match="ref counts differ"):
        check_pool(pool, [blocks, [5]])


def test_check_reports_a_block_listed_twice() -> None:
    pool = BlockPool(3, 2)
    pool._free.append(0)
    with pytest.raises(ValueError, match="^a block is listed twice among free/cached$"):
        check_pool(pool, [])
    pool = BlockPool(3, 2)
    pool._cached[0] = None
    with pytest.raises(ValueError, match="^a block is listed twice among free/cached$"):
        check_pool(pool, [])


def test_check_reports_a_lost_block() -> None:
    pool = BlockPool(3, 2)
    pool._free.remove(1)
    with pytest.raises(ValueError, match="^unowned blocks differ from free\\+cached$"):
        check_pool(pool, [])


def test_check_reports_a_hash_index_that_disagrees() -> None:
    pool = BlockPool(3, 2)
    (block,) = pool.allocate(1)
    h = put(pool, block, [9, 9])
    pool._hash_to_block[h] = 2
    with pytest.raises(ValueError, match="hash index disagrees at block 2"):
        check_pool(pool, [[block]])


def test_check_reports_a_free_block_with_a_hash() -> None:
    pool = BlockPool(3, 2)
    pool.block_hash[1] = chain_hash(None, [4])
    with pytest.raises(ValueError, match="^a free block still has a hash$"):
        check_pool(pool, [])


def test_evicted_hashed_blocks_are_listed_for_offload_and_loads_register_only_when_sound() -> None:
    from llmserve.engine.sched.block_pool import BlockContent

    pool = BlockPool(2, 2, track_evictions=True)
    a, b = pool.allocate(2)
    root = prefix_root(None)
    h = chain_hash(root, [1, 2])
    pool.register(a, h, root, [1, 2])
    pool.release([a, b])
    assert pool.take_evicted() == []
    (first,) = pool.allocate(1)  # the free block goes first: nothing evicted
    (second,) = pool.allocate(1)  # then the cached one, whose KV must be read out before it is overwritten
    assert first == b and second == a
    (evicted,) = pool.take_evicted()
    assert evicted.block == a and evicted.content == BlockContent(h, root, (1, 2))
    assert pool.take_evicted() == [] and not pool.holds(h)
    pool.release([first, second])
    ok, bad = pool.begin_load(2)
    assert len(pool._loading) == 2 and pool.is_loading(ok)
    check_pool(pool, [])  # the loads' own references balance the books
    pool.end_load(ok, BlockContent(h, root, (1, 2)))
    pool.end_load(bad, None)
    assert pool.lookup(h, root, [1, 2]) == ok and pool.block_hash[bad] is None
    with pytest.raises(ValueError, match="not loading"):
        pool.end_load(ok, None)
    check_pool(pool, [])
