"""Retries, routing metadata and per-call information shared by the sync and async clients.

A call is retried only when it is safe to: the server (or a proxy in front of it) answered UNAVAILABLE
before sending anything, so no generation reached the caller. That is a replica that was draining,
loading or gone, or a proxy with no healthy replica for a moment. A Generate stream that fails after its
first message is never retried (its tokens were already delivered), nor is DeleteSession.

Calls that name a session also carry it as `x-session-id` metadata, so that a proxy can route every turn
of a conversation to the replica that caches it (nginx `hash $http_x_session_id consistent`, Envoy ring
hash); the server names itself in the `x-llmserve-replica` trailing metadata.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

SESSION_KEY = "x-session-id"
REPLICA_KEY = "x-llmserve-replica"

Metadata = tuple[tuple[str, str], ...]


@dataclass(slots=True, frozen=True)
class Retry:
    """At most `attempts` tries in all, spaced by exponential backoff with full jitter (as gRPC's own
    retry policy does): before retry k (from 0), a random wait in [0, min(max_backoff_s, initial_backoff_s *
    multiplier**k)]. A call's deadline covers all its attempts and waits."""

    attempts: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")

    def backoff(self, retry: int) -> float:
        return random.uniform(0.0, min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retry))


DEFAULT_RETRY = Retry()
NO_RETRY = Retry(attempts=1)


@dataclass(slots=True)
class CallInfo:
    """What a call told beyond its responses. Pass one as `info=` and read it once the call has ended:
    `attempts` made, and the `replica` that served the last one (its x-llmserve-replica)."""

    attempts: int = 0
    replica: str | None = None
    trailing_metadata: Metadata = field(default_factory=tuple)

    def record(self, trailing: Sequence[tuple[str, str | bytes]] | None) -> None:
        self.trailing_metadata = tuple((k, v) for k, v in (trailing or ()) if isinstance(v, str))
        self.replica = next((v for k, v in self.trailing_metadata if k == REPLICA_KEY), None)


class Attempts:
    """One logical call's attempts: the time left for the next one, and whether and when to retry."""

    def __init__(self, policy: Retry, timeout: float | None, info: CallInfo | None = None) -> None:
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.info = info if info is not None else CallInfo()
        self.info.attempts = 0

    def start(self) -> float | None:
        """Count an attempt; its timeout (what is left of the deadline)."""
        self.info.attempts += 1
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def retry_after(self, error: grpc.RpcError) -> float | None:
        """Seconds to wait before the next attempt, or None when `error` must reach the caller."""
        retries_done = self.info.attempts - 1
        if error.code() != grpc.StatusCode.UNAVAILABLE or self.info.attempts >= self.policy.attempts:
            return None
        delay = self.policy.backoff(retries_done)
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return None
        return delay


def session_metadata(session_id: str) -> Metadata:
    """The routing metadata of a call about `session_id` (none without one)."""
    return ((SESSION_KEY, session_id),) if session_id else ()
