"""Which Generate streams may start: draining, the server's and each identity's stream caps, duplicate ids.

Also the one scoping rule for caller-named ids: with authentication on, request and session ids are unique
per identity, not across identities (`scoped`).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from llmserve.api.errors import RETRY_DELAY_S, ServiceError
from llmserve.api.limits import quote_prefix

# How long a call whose request_id is still in flight waits for that stream to end (it may have just been
# cancelled) before the id counts as a duplicate.
REUSE_WAIT_S = 0.5

StreamKey = tuple[str | None, str]  # (identity, request_id)


def scoped(identity: str | None, name: str) -> str:
    """`name` within `identity`'s namespace; injective, and `name` itself when authentication is off.

    The engine's request ids, the session cache's keys and the history store's keys all go through here.
    """
    return name if identity is None else f"{len(identity)}:{identity}/{name}"


class Admission:
    """The streams in flight, counted in by `admit` and out by `release` (on the event loop only)."""

    def __init__(self, max_streams: int, max_per_identity: int | None) -> None:
        self._max_streams = max_streams
        self._max_per_identity = max_per_identity
        self.draining = False
        self._in_flight: dict[StreamKey, asyncio.Event] = {}  # -> set when that stream has ended
        self._per_identity: Counter[str | None] = Counter()
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._in_flight)

    def ended(self, key: StreamKey) -> asyncio.Event:
        """The event set when the stream counted in under `key` ends."""
        return self._in_flight[key]

    async def wait_idle(self) -> None:
        """Return once no stream is in flight."""
        await self._idle.wait()

    async def admit(self, identity: str | None, request_id: str) -> StreamKey:
        """Count a new stream in, or refuse it (draining, at a limit, duplicate id). Returns its key for `release`."""
        key = (identity, request_id)
        while (previous := self._in_flight.get(key)) is not None:
            # A caller that cancels a call and reuses its id at once sends the new call right behind the
            # cancellation, which reaches the old handler a moment later: let it end before calling the id a
            # duplicate.
            try:
                await asyncio.wait_for(previous.wait(), REUSE_WAIT_S)
            except TimeoutError:
                raise ServiceError(
                    grpc.StatusCode.ALREADY_EXISTS, f"request_id {quote_prefix(request_id)} is already in flight"
                ) from None
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if len(self._in_flight) >= self._max_streams:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self._in_flight)} Generate streams in flight, the server's limit (--max-concurrent-streams); "
                "retry later",
                retry_after_s=RETRY_DELAY_S,
            )
        cap = self._max_per_identity
        if cap is not None and self._per_identity[identity] >= cap:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{cap} Generate streams in flight for this caller, the limit (--max-streams-per-identity); "
                "retry later",
                retry_after_s=RETRY_DELAY_S,
            )
        self._in_flight[key] = asyncio.Event()
        self._per_identity[identity] += 1
        self._idle.clear()
        return key

    def release(self, key: StreamKey) -> None:
        self._in_flight.pop(key).set()
        identity = key[0]
        self._per_identity[identity] -= 1
        if not self._per_identity[identity]:
            del self._per_identity[identity]
        if not self._in_flight:
            self._idle.set()
