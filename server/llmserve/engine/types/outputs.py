"""What comes out of the engine, at both of its seams.

The caller's side: one `Delta` per step of its stream, the last with its `FinishReason`, `Usage` and `Timing`;
`TokenLogprob` when it asked for logprobs. Plain records, so that the gRPC edge converts them to protobuf as they
are (api/convert.py).

The core's side: per request and per step, an `EngineOutput` (token ids, logprobs and finish facts; no text: the core
never detokenizes). The front end's output processor (frontend/output_processor.py) turns these into the caller's
deltas (text, stop strings, usage and timing) on the event loop, off the step thread (vLLM v1's EngineCoreOutput and
OutputProcessor split the same way). Every way a request ends (finished, aborted, failed, the core dead or stopped)
gives one final output, built by `ended`, with its usage and timing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace


class FinishReason(enum.Enum):
    """Why a request ended (the proto's FinishReason, api/convert.py)."""

    LENGTH = "length"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"
    CONSTRAINT = "constraint"  # the request's constraint is complete and admits nothing more


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of the chosen token under the model's raw distribution, and the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class Timing:
    """Seconds: queued before the first forward, to the first token, and in all."""

    queue_s: float
    ttft_s: float
    total_s: float


@dataclass(slots=True)
class Delta:
    """What one engine iteration produced for one request. The last one has `finish_reason` set."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    seed: int | None = None
    error: str | None = None
    index: int = 0  # the completion it belongs to (0 unless the request asked for n > 1)
    total_usage: Usage | None = None  # on an n > 1 request's very last delta: the prompt once, completions summed
    matched_stop: str | None = None  # the stop sequence that ended it (finish STOP_SEQUENCE)
    embedding: list[float] | None = None  # a pooling request's vector, on its only (final) delta
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. scored, on the first delta when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: Delta) -> Delta:
        """This delta followed by a later one of the same completion, as one (for a reader that fell behind)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        # The later delta's finish facts; the token ids, text and logprobs of both; the earlier's prompt logprobs.
        tokens, text = self.token_ids + later.token_ids, self.text + later.text
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return replace(later, token_ids=tokens, text=text, logprobs=logprobs, index=self.index, prompt_logprobs=prompt)


@dataclass(slots=True, frozen=True)
class RequestStart:
    """A request's accounts as they stand at its first token, so that whoever ends the request without the core
    (the front end at a stop string, the client of a core that died) can report its usage and timing."""

    num_prompt: int
    num_cached_prompt: int
    seed: int | None
    arrival: float  # time.monotonic() when the core took the request
    queued_s: float
    ttft_s: float

    def usage(self, num_generated: int) -> Usage:
        return Usage(self.num_prompt, self.num_cached_prompt, num_generated)

    def timing(self, now: float) -> Timing:
        return Timing(self.queued_s, self.ttft_s, now - self.arrival)


@dataclass(slots=True)
class EngineOutput:
    """One request's share of one step (or of an abort, a deadline or a failure: then `token_ids` is empty).

    `start` is set on the output that carries the first token. The last output of a request has
    `finish_reason`, `usage`, `timing`, `seed` and, for ERROR, `error` (see `ended`).
    """

    handle: int
    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    start: RequestStart | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    seed: int | None = None
    error: str | None = None
    embedding: list[float] | None = None  # a pooling request's vector, on its final output
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first token's output, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def ended(
    handle: int,
    request_id: str,
    reason: FinishReason,
    usage: Usage,
    timing: Timing,
    *,
    seed: int | None = None,
    error: str | None = None,
    last: EngineOutput | None = None,
) -> EngineOutput:
    """A request's final output: `last` (the output of its last token, when a token ended it) finished, else one
    with no tokens."""
    output = last if last is not None else EngineOutput(handle, request_id, [])
    output.finish_reason = reason
    output.usage = usage
    output.timing = timing
    output.seed = seed
    output.error = error
    return output


def ended_unstarted(
    handle: int, request_id: str, num_prompt: int, arrival: float, reason: FinishReason, error: str | None = None
) -> EngineOutput:
    """The final output of a request that ended before its first forward (never scheduled: the core dead, its
    grammar refused, aborted while it compiled): nothing computed, queued all along."""
    waited = time.monotonic() - arrival
    timing = Timing(waited, waited, waited)
    return ended(handle, request_id, reason, Usage(num_prompt, 0, 0), timing, error=error)
