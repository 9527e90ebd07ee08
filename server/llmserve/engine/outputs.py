"""What the engine core hands its front end: per request and per step, token ids, logprobs and finish facts.

No text here: the core never detokenizes. The front end's output processor (output_processor.py) turns these
into the caller's `Delta`s (text, stop strings, usage and timing) on the event loop, off the step thread
(vLLM v1's EngineCoreOutput and OutputProcessor split the same way). Every way a request ends (finished, aborted,
failed, the core dead or stopped) gives one final output, built by `ended`, with its usage and timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmserve.engine.delta import FinishReason, Timing, TokenLogprob, Usage


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
