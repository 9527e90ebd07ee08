"""SubscribeKvEvents' publisher: the engine's prefix-cache events (engine/sched/kv_events.py) as smg's KvEventBatch
stream.

The event loop polls the engine for what its pool stored and removed (every POLL_S, never waiting on the step
loop) and publishes one batch per cache salt: each salt is a channel of its own, numbered 1, 2, 3... with the last
HISTORY batches kept for a subscriber that reconnects from the number it last applied. A subscriber only ever sees
the channel of its own salt (its identity's, the same rule as its requests' prefix cache: none with authentication
off or --shared-prefix-cache), so no caller learns what another identity's prompts put in the cache. Each
subscriber holds at most PENDING batches: one that falls behind is ended DATA_LOSS (smg then clears what it knew of
this replica and subscribes afresh), and so is every subscriber when the engine's own bounded log dropped events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto.generated import common_pb2

from llmserve.api.errors import ServiceError
from llmserve.engine.types.kv_cache import UNKNOWN_SALT, KvEvent, KvStored
from llmserve.engine.types.protocol import Engine

log = logging.getLogger("llmserve")

POLL_S = 0.05
HISTORY = 1024  # batches kept per channel for replay
PENDING = 256  # batches one subscriber may have unread
MAX_CHANNELS = 1024  # salts with a channel; the idle ones go first beyond it


def block_id(digest: bytes) -> int:
    """A block's 128-bit digest as the protocol's 64-bit id (its first 8 bytes, as a signed integer)."""
    return int.from_bytes(digest[:8], "little", signed=True)


def to_batch(number: int, events: list[KvEvent], block_size: int) -> common_pb2.KvEventBatch:
    batch = common_pb2.KvEventBatch(sequence_number=number, timestamp=time.time())
    for event in events:
        if isinstance(event, KvStored):
            block = common_pb2.KvBlock(
                block_hash=block_id(event.block_hash), token_ids=event.tokens, block_size=block_size
            )
            stored = common_pb2.KvBlocksStored(blocks=[block], tier=common_pb2.KV_CACHE_TIER_DEVICE)
            if event.parent is not None:
                stored.parent_block_hash = block_id(event.parent)
            batch.events.add(event_id=event.number, stored=stored)
        else:
            removed = common_pb2.KvBlocksRemoved(block_hashes=[block_id(event.block_hash)])
            batch.events.add(event_id=event.number, removed=removed)
    return batch


def _nothing() -> None:
    pass


@dataclass(slots=True, eq=False)
class _Subscriber:
    pending: deque[common_pb2.KvEventBatch] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lost: str | None = None  # why it was ended


@dataclass(slots=True)
class _Channel:
    last: int = 0  # the number of the last batch published
    history: deque[common_pb2.KvEventBatch] = field(default_factory=lambda: deque(maxlen=HISTORY))
    subscribers: set[_Subscriber] = field(default_factory=set)


class KvEventPublisher:
    """Polls `engine()` once the first subscriber comes; `close` stops it. `sent` is called with each batch handed
    to a subscriber's stream (the metrics count them: how far a gateway's view of this replica's cache has come)."""

    def __init__(self, engine: Callable[[], Engine | None], sent: Callable[[], None] | None = None) -> None:
        self._engine = engine
        self._sent = sent if sent is not None else _nothing
        self._channels: dict[str | None, _Channel] = {}
        self._poller: asyncio.Task[None] | None = None
        self._next_number = 0  # of the engine's next event; 0 before the first

    async def subscribe(self, salt: str | None, start: int) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The channel of `salt` from batch `start` + 1 (0: from now on)."""
        channel = self._channels.pop(salt, None) or _Channel()
        self._channels[salt] = channel  # the most recently used last
        self._evict_idle()
        replay = [b for b in channel.history if b.sequence_number > start] if start else []
        oldest = channel.history[0].sequence_number if channel.history else channel.last + 1
        if start and not oldest - 1 <= start <= channel.last:
            raise ServiceError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"start_sequence_number {start} is not in this replica's history ({oldest - 1} to {channel.last}): "
                "subscribe from 0",
            )
        subscriber = _Subscriber()
        channel.subscribers.add(subscriber)
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())
        try:
            for batch in replay:
                yield batch
                self._sent()
            while True:
                await subscriber.wake.wait()
                subscriber.wake.clear()
                while subscriber.pending:
                    yield subscriber.pending.popleft()
                    self._sent()
                if subscriber.lost is not None:
                    raise ServiceError(grpc.StatusCode.DATA_LOSS, subscriber.lost)
        finally:
            channel.subscribers.discard(subscriber)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    async def _poll(self) -> None:
        while True:
            engine = self._engine()
            if engine is not None:
                try:
                    self.publish(engine.take_kv_events(), engine.stats().block_size)
                except Exception:  # a bug here must not end the poller: the gateways would see nothing more
                    log.exception("KV event publishing failed")
            await asyncio.sleep(POLL_S)

    def publish(self, events: list[KvEvent], block_size: int) -> None:
        """One batch per channel that has events among `events`; a gap in their numbers ends every subscriber."""
        if not events:
            return
        if self._next_number and events[0].number != self._next_number:
            self._lose_all(f"the engine dropped {events[0].number - self._next_number} KV events: subscribe from 0")
        self._next_number = events[-1].number + 1
        by_salt: dict[str | None, list[KvEvent]] = {}
        for event in events:
            if event.salt != UNKNOWN_SALT and event.salt in self._channels:
                by_salt.setdefault(event.salt, []).append(event)
        for salt, own in by_salt.items():
            channel = self._channels[salt]
            channel.last += 1
            batch = to_batch(channel.last, own, block_size)
            channel.history.append(batch)
            for subscriber in channel.subscribers:
                if subscriber.lost is not None:
                    continue
                if len(subscriber.pending) >= PENDING:
                    subscriber.lost = f"the subscriber fell {PENDING} batches behind: subscribe from 0"
                else:
                    subscriber.pending.append(batch)
                subscriber.wake.set()

    def _lose_all(self, why: str) -> None:
        for channel in self._channels.values():
            channel.history.clear()  # nothing before the gap can be replayed
            for subscriber in channel.subscribers:
                subscriber.lost = why
                subscriber.wake.set()

    def _evict_idle(self) -> None:
        idle = [salt for salt, channel in self._channels.items() if not channel.subscribers]
        for salt in idle[: max(0, len(self._channels) - MAX_CHANNELS)]:
            del self._channels[salt]
