"""What the edge hands to metrics and tracing once a Generate call has ended: one `FinishedCall`.

The servicer records a call as it goes (times of the tokens it sent, the engine's usage and timing) and,
in one place when the call ends whatever the ending, gives each `CallObserver` the finished record. An
observer never sees a request's content, only its sizes, times and outcome.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class FinishedCall:
    """One Generate call, ended. Times are time.monotonic() seconds; `start_ns` is the wall clock at `start`."""

    code: str  # the gRPC status name the caller got: "OK", "CANCELLED", "INVALID_ARGUMENT", ...
    start: float
    end: float
    start_ns: int
    # Set once the request was handed to the engine (valid, admitted); the rest is meaningful only then.
    queued: float | None = None
    finish_reason: str | None = None  # the engine's ("length", "eos", ...), or "cancelled"/"deadline" for the caller's
    token_times: list[float] = field(default_factory=list)  # when each response with tokens was sent
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float | None = None  # the engine's queue time; only known when the engine's last message arrived
    has_session: bool = False
    metadata: Sequence[tuple[str, str | bytes]] = ()  # the call's request metadata (trace context)

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def wall_ns(self, t: float) -> int:
        """A time.monotonic() time of this call on the wall clock, in nanoseconds."""
        return self.start_ns + round((t - self.start) * 1e9)


class CallObserver(Protocol):
    """Told about every Generate call once it ends; must be quick and must not raise."""

    def call_finished(self, call: FinishedCall) -> None: ...
