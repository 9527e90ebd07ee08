"""A generation request as the caller asks for it: `GenerationRequest` with its `SamplingParams`,
`StoppingParams` and `ConstraintSpec`, and the checks of a request, errors named by field: of its values
(`GenerationRequest.validate`), and against the facts of the core that would serve it (`CoreFacts`, `validate`;
the core states them once, a core in a process of its own sends them at start-up).

Immutable and torch-free, so that the gRPC edge builds them from protobuf (api/convert.py) and they cross to an
engine process as they are. What the engine keeps for a request is sched/sequence.py's; what it hands back,
outputs.py's.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from llmserve.engine.types.adapters import AdapterAnswer, adapter_name_problem
from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.kv_cache import blocks_for
from llmserve.engine.types.pooling import PoolingMode

MAX_TOP_LOGPROBS = 20
# Sampling values past these act as the bound (see SamplingParams): beyond them float32 arithmetic would
# underflow to 0 or overflow to inf, and the bound already gives the limit's distribution.
MIN_TEMPERATURE = 1e-5  # below: greedy, as in vLLM
MAX_TEMPERATURE = 1e6  # above: as 1e6, uniform over the tokens left to float32 precision
PENALTY_RANGE = (1e-6, 1e6)  # repetition_penalty is applied clamped into this range
# OpenAI's bounds for frequency_penalty/presence_penalty and for each logit_bias value.
ADDITIVE_PENALTY_BOUND = 2.0
LOGIT_BIAS_BOUND = 100.0


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How the next token is picked. temperature 0 means greedy; top_k 0 and top_p 1 mean off.

    Every value that passes `validate` is served. Extremes act as documented equivalents: a temperature
    below MIN_TEMPERATURE is greedy, above MAX_TEMPERATURE it acts as MAX_TEMPERATURE; repetition_penalty
    is applied clamped into PENALTY_RANGE; a top_p too small to keep anything keeps the best token.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # OpenAI's semantics, over the generated tokens only (not the prompt): a token generated c times has
    # c * frequency_penalty + (c > 0) * presence_penalty subtracted from its logit.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # (token id, bias) pairs, each id once: the bias is added to that token's logit every step.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def edits_logits(self) -> bool:
        """Whether any penalty or bias changes the logits before the pick (greedy rows then need the full path)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )

    def validate(self) -> None:
        """Raise InvalidRequest naming the first field out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("sampling.temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest("sampling.top_k", f"must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest("sampling.min_p", f"must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest("sampling.repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequest("sampling.seed", f"must be in [0, 2**63), got {self.seed}")
        bound = ADDITIVE_PENALTY_BOUND
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -bound <= value <= bound):
                raise InvalidRequest(f"sampling.{name}", f"must be in [-{bound:g}, {bound:g}], got {value}")
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            if not (math.isfinite(bias) and -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND):
                raise InvalidRequest(
                    "sampling.logit_bias",
                    f"token {token_id}: bias must be in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], got {bias}",
                )
            if token_id in seen:
                raise InvalidRequest("sampling.logit_bias", f"token {token_id} is given twice")
            seen.add(token_id)


@dataclass(slots=True, frozen=True)
class StoppingParams:
    """When generation ends. Stop sequences are matched on text, across token boundaries."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_sequence: bool = False
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequest("stopping.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise InvalidRequest("stopping.min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequest("stopping.min_new_tokens", "must not exceed max_new_tokens")
        if any(not s for s in self.stop_sequences):
            raise InvalidRequest("stopping.stop_sequences", "must not contain an empty string")


class ConstraintKind(enum.Enum):
    """What a constraint's text is; the value is the request field's name (under `constraint.`)."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"


@dataclass(slots=True, frozen=True)
class ConstraintSpec:
    """A constraint on the generated text, as the caller wrote it (compiled by sample/constraints.py).

    `text` is the schema, regex or grammar; `choices` the strings of a choice. Hashable: it is the key of
    the compile cache.
    """

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The request field it came from, for error messages."""
        suffix = ".options" if self.kind is ConstraintKind.CHOICE else ""
        return f"constraint.{self.kind.value}{suffix}"


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """What a pooling request (Embed's, one per input) asks instead of tokens: its prompt's final hidden states
    pooled by `mode`, the first `dimensions` entries kept (None: all), then normalized when `normalize`. A request
    with pooling is prefill only: it never samples, and ends once its prompt is read (finish reason LENGTH) with
    its vector in its final output (outputs.EngineOutput.embedding)."""

    mode: PoolingMode
    normalize: bool = False
    dimensions: int | None = None


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    """A request as the engine accepts it: prompt already tokenized.

    `deadline` is on the `time.monotonic()` clock; `priority` orders the waiting queue (higher first).
    `cache_salt` scopes automatic prefix caching: only requests with the same salt share cached blocks.
    `adapter` names the LoRA adapter to generate with (None: the base model); cached KV is per adapter too.
    `n` > 1: n completions of the prompt that share its KV (frontend/fanout.py); never with a session (one answer).
    `prompt_field` is the caller's name for the prompt, which errors about it name (the gRPC edge sets the
    input the prompt came from: `text`, `chat` or `token_ids.ids`).
    `prompt_logprobs`: the log-probability of each prompt token after the first (and the `prompt_top_logprobs` most
    likely tokens at its position) comes with the first output. Such a request reads no cached KV for its prompt
    (prefix cache, session, KV tiers: it recomputes, as vLLM does), so its values never depend on what was cached;
    the blocks it computes still enter the prefix cache.
    `token_type_ids`: the segment of each prompt token (a text pair's second text is segment 1, as BERT's tokenizer
    marks it), for an encoder that has segment embeddings; empty: all segment 0. Decoders have none and ignore it.

    Errors name each field by its path in the protobuf GenerateRequest (`sampling.top_p`,
    `stopping.max_new_tokens`, `response.top_logprobs`), which for sampling and stopping is also its
    attribute path here: the gRPC edge passes them on as they are.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stopping: StoppingParams = StoppingParams()
    session_id: str | None = None
    deadline: float | None = None
    priority: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    cache_salt: str | None = None
    constraint: ConstraintSpec | None = None
    prompt_field: str = "prompt_token_ids"
    n: int = 1
    adapter: str | None = None
    pooling: PoolingParams | None = None  # a pooling request (Embed's): prefill only, one vector out
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    token_type_ids: tuple[int, ...] = ()

    def validate(
        self, vocab_size: int, max_model_len: int, max_top_logprobs: int = MAX_TOP_LOGPROBS, max_n: int = 1
    ) -> None:
        """Check every value against its range, the vocabulary and the context; raise InvalidRequest naming the
        field. The one place these are checked (the edge bounds only sizes: api/limits.py)."""
        if not self.request_id:
            raise InvalidRequest("request_id", "must not be empty")
        n = len(self.prompt_token_ids)
        if n == 0:
            raise InvalidRequest(self.prompt_field, "must not be empty")
        # A pooling request samples nothing: its prompt may fill the context (an encoder's 512 positions, as
        # sentence-transformers reads them); a generating one leaves room for its first token.
        if n > max_model_len or (n == max_model_len and self.pooling is None):
            raise InvalidRequest(self.prompt_field, f"is {n} tokens, the context holds {max_model_len}")
        if any(t < 0 or t >= vocab_size for t in self.prompt_token_ids):
            raise InvalidRequest(self.prompt_field, f"ids must be in [0, {vocab_size})")
        if self.token_type_ids and len(self.token_type_ids) != n:
            raise InvalidRequest("token_type_ids", f"has {len(self.token_type_ids)} entries for {n} prompt tokens")
        if any(t < 0 for t in self.token_type_ids):
            raise InvalidRequest("token_type_ids", "must be >= 0")
        self.sampling.validate()
        self.stopping.validate()
        if self.pooling is None and n + self.stopping.max_new_tokens > max_model_len:
            raise InvalidRequest(
                "stopping.max_new_tokens",
                f"prompt ({n}) + max_new_tokens ({self.stopping.max_new_tokens}) exceeds the context ({max_model_len})",
            )
        if any(t < 0 or t >= vocab_size for t in self.stopping.stop_token_ids):
            raise InvalidRequest("stopping.stop_token_ids", f"ids must be in [0, {vocab_size})")
        if any(t < 0 or t >= vocab_size for t, _ in self.sampling.logit_bias):
            raise InvalidRequest("sampling.logit_bias", f"token ids must be in [0, {vocab_size})")
        if not (0 <= self.top_logprobs <= max_top_logprobs):
            raise InvalidRequest(
                "response.top_logprobs",
                f"must be in [0, {max_top_logprobs}] (--max-top-logprobs), got {self.top_logprobs}",
            )
        if not (0 <= self.prompt_top_logprobs <= max_top_logprobs):
            raise InvalidRequest(
                "response.prompt_top_logprobs",
                f"must be in [0, {max_top_logprobs}] (--max-top-logprobs), got {self.prompt_top_logprobs}",
            )
        if not (1 <= self.n <= max_n):
            raise InvalidRequest("n", f"must be in [1, {max_n}] (--max-n), got {self.n}")
        if self.n > 1 and self.session_id is not None:
            raise InvalidRequest("n", "must be 1 with session_id: a session continues one answer, not n")
        if self.adapter is not None and (problem := adapter_name_problem(self.adapter)) is not None:
            raise InvalidRequest("adapter", problem)


@dataclass(slots=True, frozen=True)
class CoreFacts:
    max_model_len: int  # the context cap: the model's, the flag's or the sliding window's, whichever is least
    sliding_window: int | None
    vocab_size: int
    num_blocks: int  # the KV pool's
    block_size: int
    max_top_logprobs: int
    max_n: int
    backend_name: str
    backend_description: str
    lora: AdapterAnswer | None = None  # the adapters at start and the LoRA limits; None when LoRA is off
    generates: bool = True  # False for an encoder: it serves pooling requests only
    pools: bool = False  # whether it serves pooling requests (an encoder, or a decoder with its pooling configured)
    max_pooling_tokens: int = 0  # the most tokens of one pooling request (engine_core.pooling_limit)


def validate(request: GenerationRequest, facts: CoreFacts) -> None:
    """Raise InvalidRequest naming the field when `request` cannot be served by this core."""
    request.validate(facts.vocab_size, facts.max_model_len, facts.max_top_logprobs, facts.max_n)
    # The gRPC edge answers both FAILED_PRECONDITION before a request is built; here for any other caller.
    if request.pooling is None and not facts.generates:
        raise InvalidRequest(request.prompt_field, "the model does not generate: it serves pooling requests only")
    if request.pooling is not None and not facts.pools:
        raise InvalidRequest(request.prompt_field, "the model serves no pooling requests")
    if request.pooling is not None and len(request.prompt_token_ids) > facts.max_pooling_tokens:
        raise InvalidRequest(
            request.prompt_field,
            f"is {len(request.prompt_token_ids)} tokens, a pooling input holds at most {facts.max_pooling_tokens}",
        )
    total = len(request.prompt_token_ids) + request.stopping.max_new_tokens
    if blocks_for(total, facts.block_size) > facts.num_blocks:
        raise InvalidRequest(
            "stopping.max_new_tokens",
            f"prompt + max_new_tokens = {total} tokens never fits the KV pool "
            f"({facts.num_blocks * facts.block_size} tokens)",
        )
