"""The block pool's KV events (sched/kv_events.py): what is stored and removed, with parents and salts, numbered and
bounded; and the front end's publisher of them (api/kv_publisher.py), per salt, with replay and its bounds."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmserve.api.errors import ServiceError
from llmserve.api.kv_publisher import PENDING, KvEventPublisher, block_id
from llmserve.engine.sched.block_pool import BlockPool, chain_hash, prefix_root
from llmserve.engine.sched.kv_events import KvEventLog
from llmserve.engine.types.kv_cache import UNKNOWN_SALT, KvRemoved, KvStored


def chain(pool: BlockPool, tokens: list[int], salt: str | None) -> list[bytes]:
    """Register a prompt's full blocks as the scheduler does; returns their digests."""
    bs, parent, hashes = pool.block_size, prefix_root(salt), []
    blocks = pool.allocate(len(tokens) // bs)
    for i, block in enumerate(blocks):
        part = tokens[i * bs : (i + 1) * bs]
        digest = chain_hash(parent, part)
        pool.register(block, digest, parent, part, salt)
        hashes.append(digest)
        parent = digest
    pool.release(blocks)
    return hashes


def test_stored_blocks_name_their_parent_tokens_and_salt_and_evictions_are_removed() -> None:
    log = KvEventLog()
    pool = BlockPool(4, 2, events=log)
    first = chain(pool, [1, 2, 3, 4], "alice")
    events = log.take()
    assert events == [
        KvStored(1, first[0], None, (1, 2), "alice"),  # a chain's first block: its parent is the salt's root
        KvStored(2, first[1], first[0], (3, 4), "alice"),
    ]
    assert log.take() == []
    pool.allocate(3)  # two free blocks, then the oldest cached one is evicted
    assert log.take() == [KvRemoved(3, first[0], "alice")]
    # A block registered again under an unknown salt (a tier's reload) takes its held parent's salt.
    pool2 = BlockPool(4, 2, events=KvEventLog())
    (root_block,) = chain(pool2, [5, 6], None)
    (block,) = pool2.allocate(1)
    pool2.register(block, chain_hash(root_block, [7, 8]), root_block, [7, 8])
    assert pool2.events is not None and pool2.events.take()[-1].salt is None
    (orphan,) = pool2.allocate(1)
    pool2.register(orphan, chain_hash(b"gone" * 4, [9, 9]), b"gone" * 4, [9, 9])
    last = pool2.events.take()[-1]
    assert isinstance(last, KvStored) and (last.salt, last.parent) == (UNKNOWN_SALT, None)


def test_a_full_log_drops_its_oldest_and_the_numbers_show_the_gap() -> None:
    log = KvEventLog(capacity=3)
    for i in range(5):
        log.removed(bytes([i]) * 16, None)
    assert [e.number for e in log.take()] == [3, 4, 5]


def stored(number: int, salt: str | None, tokens: tuple[int, ...] = (1, 2)) -> KvStored:
    return KvStored(number, number.to_bytes(16, "little"), None, tokens, salt)


async def take(stream, n: int) -> list:
    return [await asyncio.wait_for(anext(stream), 2) for _ in range(n)]


async def test_each_salt_is_a_channel_of_its_own_with_replay() -> None:
    publisher = KvEventPublisher(lambda: None)
    alice = publisher.subscribe("alice", 0)
    bob = publisher.subscribe("bob", 0)
    pending = [asyncio.ensure_future(anext(s)) for s in (alice, bob)]
    await asyncio.sleep(0)
    publisher.publish([stored(1, "alice"), stored(2, "bob", (7, 7)), stored(3, UNKNOWN_SALT), stored(4, "alice")], 2)
    a, b = [await asyncio.wait_for(p, 2) for p in pending]
    assert (a.sequence_number, [e.stored.blocks[0].token_ids for e in a.events]) == (1, [[1, 2], [1, 2]])
    assert (b.sequence_number, [e.stored.blocks[0].token_ids for e in b.events]) == (1, [[7, 7]])
    assert a.events[0].stored.blocks[0].block_hash == block_id((1).to_bytes(16, "little")) == 1
    publisher.publish([stored(5, "alice")], 2)
    assert [x.sequence_number for x in await take(alice, 1)] == [2]
    # A subscriber that reconnects after batch 1 gets batch 2 again, then goes on live.
    again = publisher.subscribe("alice", 1)
    assert [x.sequence_number for x in await take(again, 1)] == [2]
    with pytest.raises(ServiceError) as err:
        await anext(publisher.subscribe("alice", 9))
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
    for stream in (alice, bob, again):
        await stream.aclose()


async def test_a_subscriber_that_falls_behind_and_an_engine_gap_end_with_data_loss() -> None:
    publisher = KvEventPublisher(lambda: None)
    slow = publisher.subscribe(None, 0)
    first = asyncio.ensure_future(anext(slow))
    await asyncio.sleep(0)
    for n in range(1, PENDING + 3):
        publisher.publish([stored(n, None)], 2)
    await first
    with pytest.raises(ServiceError) as err:
        while True:
            await asyncio.wait_for(anext(slow), 2)
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    live = publisher.subscribe(None, 0)
    waiting = asyncio.ensure_future(anext(live))
    await asyncio.sleep(0)
    publisher.publish([stored(PENDING + 10, None)], 2)  # numbers skipped: the engine's log dropped some
    with pytest.raises(ServiceError) as err:
        await asyncio.wait_for(waiting, 2)
        await asyncio.wait_for(anext(live), 2)
    assert err.value.code == grpc.StatusCode.DATA_LOSS


async def test_each_batch_written_to_a_subscriber_is_counted_once_it_is_written() -> None:
    """The count the metrics report (llmserve_kv_event_batches_sent_total): a batch counts once the stream has taken
    it and asks for the next, that is once gRPC has written it; a replayed batch counts as well."""
    sent: list[int] = []
    publisher = KvEventPublisher(lambda: None, lambda: sent.append(1))
    stream = publisher.subscribe(None, 0)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    publisher.publish([stored(1, None)], 2)
    publisher.publish([stored(2, None)], 2)
    await asyncio.wait_for(first, 2)
    assert sent == []  # taken, not yet written
    await asyncio.wait_for(anext(stream), 2)
    assert len(sent) == 1
    again = publisher.subscribe(None, 1)
    assert [x.sequence_number for x in await take(again, 1)] == [2]  # the replay
    publisher.publish([stored(3, None)], 2)
    assert [x.sequence_number for x in await take(again, 1)] == [3]
    assert len(sent) == 2  # stream's batch 1 and again's replayed batch 2
    for s in (stream, again):
        await s.aclose()
