"""Which calls may start: draining, the server's and each identity's caps, duplicate ids.

A Generate stream counts one against the stream caps (--max-concurrent-streams, --max-streams-per-identity). A
pooling call (Embed, Rerank, and any RPC that turns each of its inputs into an engine request) counts its inputs against
caps of their own (--max-pooling-inputs, and per identity the same share of it as of the streams), admitted whole
or refused whole: a large call never takes the streams' slots, and never half enters the engine. The stream and
input caps together stay within the engine's queue (--max-waiting 1024 = 256 streams + 768 inputs by default), so
that embedding traffic cannot make Generate's queue full.

Also the one scoping rule for caller-named ids: with authentication on, request and session ids are unique
per identity, not across identities (`scoped`).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from llmserve.api.errors import RETRY_DELAY_S, ServiceError
from llmserve.api.limits import quote_prefix
from llmserve.config import ServerConfig

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
    """The calls in flight, counted in by `admit` (a Generate stream) or `admit_pooling` (a pooling call's inputs)
    and out by `release` (on the event loop only).

    `max_pooling_inputs`: the inputs of pooling calls in flight at once, at least `max_call_inputs` (one call of
    the most inputs a call may carry, --max-embed-inputs, always fits an empty server); per identity, with
    `max_per_identity` set, the share `max_per_identity / max_streams` of it, and again at least one whole call."""

    def __init__(
        self, max_streams: int, max_per_identity: int | None, max_pooling_inputs: int = 768, max_call_inputs: int = 1
    ) -> None:
        self._max_streams = max_streams
        self._max_per_identity = max_per_identity
        self.max_inputs = max(max_pooling_inputs, max_call_inputs)
        self.max_inputs_per_identity = (
            None
            if max_per_identity is None
            else max(max_call_inputs, self.max_inputs * max_per_identity // max_streams)
        )
        self.draining = False
        self._in_flight: dict[StreamKey, asyncio.Event] = {}  # -> set when that call has ended
        self._inputs: dict[StreamKey, int] = {}  # a pooling call's inputs, by its key (streams are not here)
        self._streams = 0
        self._num_inputs = 0
        self._per_identity: Counter[str | None] = Counter()
        self._inputs_per_identity: Counter[str | None] = Counter()
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    def of(cls, config: ServerConfig) -> Admission:
        """The admission of a server with `config`'s caps."""
        return cls(
            config.max_concurrent_streams,
            config.max_streams_per_identity,
            config.max_pooling_inputs,
            config.limits.max_embed_inputs,
        )

    def __len__(self) -> int:
        """Calls in flight: Generate streams and pooling calls."""
        return len(self._in_flight)

    @property
    def inputs_in_flight(self) -> int:
        return self._num_inputs

    def ended(self, key: StreamKey) -> asyncio.Event:
        """The event set when the stream counted in under `key` ends."""
        return self._in_flight[key]

    async def wait_idle(self) -> None:
        """Return once no stream is in flight."""
        await self._idle.wait()

    async def admit(self, identity: str | None, request_id: str) -> StreamKey:
        """Count a new stream in, or refuse it (draining, at a limit, duplicate id). Returns its key for `release`."""
        key = await self._new_key(identity, request_id)
        if self._streams >= self._max_streams:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._streams} Generate streams in flight, the server's limit (--max-concurrent-streams); "
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
        self._streams += 1
        self._per_identity[identity] += 1
        self._enter(key)
        return key

    async def admit_pooling(self, identity: str | None, request_id: str, inputs: int) -> StreamKey:
        """Count a pooling call of `inputs` inputs in, whole, or refuse it whole (draining, duplicate id, or its
        inputs beyond what the caps leave: RESOURCE_EXHAUSTED with a retry delay). Returns its key for `release`."""
        key = await self._new_key(identity, request_id)
        if self._num_inputs + inputs > self.max_inputs:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._num_inputs} pooling inputs in flight, {inputs} more would pass the server's limit of "
                f"{self.max_inputs} (--max-pooling-inputs); retry later",
                retry_after_s=RETRY_DELAY_S,
            )
        cap = self.max_inputs_per_identity
        if cap is not None and self._inputs_per_identity[identity] + inputs > cap:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._inputs_per_identity[identity]} pooling inputs in flight for this caller, {inputs} more "
                f"would pass its limit of {cap} (--max-streams-per-identity's share of --max-pooling-inputs); "
                "retry later",
                retry_after_s=RETRY_DELAY_S,
            )
        self._inputs[key] = inputs
        self._num_inputs += inputs
        self._inputs_per_identity[identity] += inputs
        self._enter(key)
        return key

    async def _new_key(self, identity: str | None, request_id: str) -> StreamKey:
        """The key of a new call, once no call in flight holds it; refused while draining or for a duplicate."""
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
        return key

    def _enter(self, key: StreamKey) -> None:
        self._in_flight[key] = asyncio.Event()
        self._idle.clear()

    def release(self, key: StreamKey) -> None:
        """Count the call admitted under `key` out (its stream, or its inputs)."""
        self._in_flight.pop(key).set()
        identity = key[0]
        inputs = self._inputs.pop(key, None)
        if inputs is None:
            self._streams -= 1
            _decrement(self._per_identity, identity, 1)
        else:
            self._num_inputs -= inputs
            _decrement(self._inputs_per_identity, identity, inputs)
        if not self._in_flight:
            self._idle.set()


def _decrement(counts: Counter[str | None], identity: str | None, by: int) -> None:
    counts[identity] -= by
    if not counts[identity]:
        del counts[identity]
