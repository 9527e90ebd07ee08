"""One record per Generate call: `CallRecord`, kept by the servicer as the call goes and closed once, however the
call ends, in one place. The request log line, the metrics and the trace are all made from it, so they agree.

The servicer records the times of the tokens it sent and the engine's usage and timing; `close` works out the
call's finish once (a cancel or deadline that reached the engine without a finish reason reads as one) and each
`CallObserver` is then given the closed record. An observer never sees a request's content, only its sizes,
times and outcome (the log line's prompt is opt-in, --log-prompts).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from llmserve.engine.types.outputs import Delta

STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)
# The finish of a call the engine had taken that ended by the caller's cancel or deadline before any finish reason.
_CALLER_FINISH = {"CANCELLED": "cancelled", "DEADLINE_EXCEEDED": "deadline"}


@dataclass(slots=True)
class CallRecord:
    """One Generate (or Embed) call. Times are time.monotonic() seconds; `start_ns` is the wall clock at `start`."""

    request_id: str
    start: float
    identity: str | None = None
    start_ns: int = field(default_factory=time.time_ns)
    # Set once the request was handed to the engine (valid, admitted); the counts are meaningful only then.
    queued: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each response with tokens was sent
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float | None = None  # the engine's queue time; only known when the engine's last message arrived
    finish_reason: str | None = None  # the engine's ("length", "eos", ...), or "cancelled"/"deadline" for the caller's
    # The gRPC status name the caller got, or an unexpected fault's type name (the log says which; see `code`).
    status: str = "UNKNOWN"
    end: float = 0.0  # set by close()
    has_session: bool = False
    metadata: Sequence[tuple[str, str | bytes]] = ()  # the call's request metadata (trace context)
    prompt: str | None = None  # the input text, with --log-prompts only
    method: str = "Generate"  # or "Embed"/"Rerank": then `inputs` is its input (pair) count, prompt_tokens their tokens
    inputs: int = 0
    _sent: dict[int, int] = field(default_factory=dict)  # completion index -> its tokens so far

    @property
    def code(self) -> str:
        """The gRPC status name: `status`, or UNKNOWN for a fault that maps to no status."""
        return self.status if self.status in STATUS_NAMES else "UNKNOWN"

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def wall_ns(self, t: float) -> int:
        """A time.monotonic() time of this call on the wall clock, in nanoseconds."""
        return self.start_ns + round((t - self.start) * 1e9)

    def observe(self, delta: Delta) -> None:
        """Account one delta as it is sent to the caller (of any of an n > 1 call's completions: the prompt counts
        as completion 0 counted it, the completion tokens of all of them add up)."""
        if delta.token_ids:
            self.token_times.append(time.monotonic())
        sent = self._sent.get(delta.index, 0) + len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.value
        if delta.usage is not None:
            if delta.index == 0:
                self.prompt_tokens = delta.usage.prompt_tokens
                self.cached_prompt_tokens = delta.usage.cached_prompt_tokens
            sent = delta.usage.completion_tokens
        self._sent[delta.index] = sent
        self.completion_tokens = sum(self._sent.values())
        if delta.timing is not None:
            self.queue_s = delta.timing.queue_s

    def close(self, *, has_session: bool, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """The call has ended with `status`: its end time, and its finish worked out once."""
        self.end = time.monotonic()
        self.has_session = has_session
        self.metadata = tuple(metadata or ())
        if self.finish_reason is None and self.queued is not None:
            self.finish_reason = _CALLER_FINISH.get(self.code)


class CallObserver(Protocol):
    """Told about every Generate call once it ends; must be quick and must not raise."""

    def call_finished(self, call: CallRecord) -> None: ...
