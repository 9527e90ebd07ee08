"""What a caller gets back: one `Delta` per step of its stream, the last with its `FinishReason`, `Usage` and
`Timing`; `TokenLogprob` when it asked for logprobs.

Plain records, torch-free, so that the gRPC edge converts them to protobuf as they are (api/convert.py). The core
hands its front end `EngineOutput`s (outputs.py), which the output processor turns into these.
"""

from __future__ import annotations

import enum
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: Delta) -> Delta:
        """This delta followed by a later one of the same completion, as one (for a reader that fell behind)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        # The later delta's finish facts; the token ids, text and logprobs of both.
        tokens, text = self.token_ids + later.token_ids, self.text + later.text
        return replace(later, token_ids=tokens, text=text, logprobs=logprobs, index=self.index)
