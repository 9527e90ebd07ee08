"""What the engine core hands its front end: per request and per step, token ids, logprobs and finish facts.

No text here: the core never detokenizes. The front end's output processor (output_processor.py) turns these
into the caller's `Delta`s (text, stop strings, usage and timing) on the event loop, off the step thread
(vLLM v1's EngineCoreOutput and OutputProcessor split the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.engine.request import FinishReason, Timing, TokenLogprob, Usage


@dataclass(slots=True, frozen=True)
class RequestStart:
    """A request's accounts as they stand at its first token, so that a front end that ends the request itself
    (a stop string) can report usage and timing without waiting for the core."""

    num_prompt: int
    num_cached_prompt: int
    seed: int | None
    arrival: float  # time.monotonic() when the core took the request
    queued_s: float
    ttft_s: float


@dataclass(slots=True)
class EngineOutput:
    """One request's share of one step (or of an abort, a deadline or a failure: then `token_ids` is empty).

    `start` is set on the output that carries the first token. The last output of a request has
    `finish_reason`, `usage`, `timing`, `seed` and, for ERROR, `error`.
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
