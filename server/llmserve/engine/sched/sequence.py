"""The engine's own state for one request: `Sequence` (mutable, on the step thread only) and the `SampleRow` the
sampler reads from it each step.

Neither leaves the engine: the caller's types are types/request.py's (in) and types/outputs.py's (out). A
constrained request's grammar state is a `GrammarState`, the small protocol below, so that this module needs neither
the constraint compiler (sample/constraints.py) nor a tensor library.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from llmserve.engine.sched.block_pool import prefix_root
from llmserve.engine.types.outputs import FinishReason, Timing, Usage
from llmserve.engine.types.request import GenerationRequest, SamplingParams

if TYPE_CHECKING:
    import llguidance


class HeldAdapter(Protocol):
    """The LoRA adapter a sequence holds from admission to its end (lora/serving.py's: a lora/registry.Resident).
    The books read its residency's `adapter_id` (the distinct adapters of a step); the LoRA side its `name` (None
    once unloaded) and its `payload` (the adapter's factors, lora/adapters.LoraAdapter)."""

    @property
    def adapter_id(self) -> int: ...

    @property
    def name(self) -> str | None: ...

    @property
    def payload(self) -> object: ...


class GrammarState(Protocol):
    """One request's position in its grammar (constraints.ConstraintState): advanced by each generated token on
    the step thread; the sampler masks the logits with what `matcher` allows next."""

    @property
    def matcher(self) -> llguidance.LLMatcher: ...

    def accept(self, token_id: int) -> bool: ...

    @property
    def done(self) -> bool: ...

    @property
    def error(self) -> str: ...


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs about one request for one step.

    A sampled row (not `params.greedy`) names its random stream and never holds it, so this type is torch-free:
    `key` identifies the sequence (its handle, unique in an engine), `seed` is where its stream starts; the
    backend keeps the streams (engine/streams.py). `token_ids` (prompt + generated) is only read for the
    penalties: the repetition penalty reads all of it, frequency and presence penalties only `token_ids[num_prompt:]`.
    `blocked_token_ids` are forbidden this step, e.g. EOS while under min_new_tokens. `constraint` (the
    request's grammar state) allows only the tokens that keep the generated text within its language.
    """

    params: SamplingParams
    seed: int | None
    key: int
    token_ids: Seq[int]
    blocked_token_ids: Seq[int]
    logprobs: bool
    top_logprobs: int
    num_prompt: int = 0
    constraint: GrammarState | None = None


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """The engine's state for one request.

    Prefill and decode are one mechanism: `num_computed` (tokens whose KV is in `block_table`) catches up
    with `len(token_ids)` (prompt plus generated). Preemption drops the blocks and sets num_computed to 0.
    """

    request: GenerationRequest
    token_ids: list[int]
    arrival: float
    seq_no: int
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain_hash of each full block, in order
    num_computed: int = 0
    num_cached_prompt: int = 0
    num_prompt: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    seed: int | None = None  # where a sampled request's random stream starts (the backend keeps the stream)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    stop_ids: frozenset[int] = frozenset()  # the request's stop token ids
    eos_ids: frozenset[int] = frozenset()  # the model's EOS ids, unless the request ignores EOS
    constraint: GrammarState | None = None  # the grammar state of a constrained request (generated tokens only)
    after: Sequence | None = None  # completion 0 of this n > 1 request: wait for its prompt's KV, then share it
    lora: HeldAdapter | None = None  # the LoRA adapter it holds from admission to its end (lora/serving.py)
    prefix_root: bytes = b""  # its prefix hash chain's root: its cache salt's, and its adapter's (lora/cache_keys)
    # Overlap (--async-scheduling, core/steps.py's OverlapRunner): tokens sampled by steps in flight, not yet in
    # token_ids (each a placeholder the next step's plan computes: plan.PENDING), and the length at which the request
    # ends at the latest (its max_new_tokens or the context), so that a step is never planned past it.
    num_pending: int = 0
    length_limit: int = 1 << 62
    _row: SampleRow | None = None  # sample_row() once nothing is blocked any more: it no longer changes

    def __post_init__(self) -> None:
        self.num_prompt = len(self.token_ids)
        if not self.prefix_root:
            self.prefix_root = prefix_root(self.request.cache_salt)

    @property
    def adapter_id(self) -> int | None:
        """Its LoRA adapter's residency id (one per stay in memory), None for the base model."""
        return None if self.lora is None else self.lora.adapter_id

    @classmethod
    def of(
        cls,
        request: GenerationRequest,
        seq_no: int,
        arrival: float,
        model_eos_ids: Seq[int],
        constraint: GrammarState | None,
    ) -> Sequence:
        """A new request's sequence: its prompt, its stop ids, and the model's EOS ids unless it ignores them."""
        stopping = request.stopping
        return cls(
            request,
            list(request.prompt_token_ids),
            arrival,
            seq_no,
            stop_ids=frozenset(stopping.stop_token_ids),
            eos_ids=frozenset() if stopping.ignore_eos else frozenset(model_eos_ids),
            constraint=constraint,
        )

    def sample_row(self) -> SampleRow:
        """What the sampler needs for this sequence's next token (the same object from step to step once
        min_new_tokens no longer blocks anything: its token_ids is the live list)."""
        if self._row is not None:
            return self._row
        request = self.request
        blocking = self.num_generated + self.num_pending < request.stopping.min_new_tokens
        row = SampleRow(
            params=request.sampling,
            seed=self.seed,
            key=self.seq_no,
            token_ids=self.token_ids,
            blocked_token_ids=tuple(self.stop_ids | self.eos_ids) if blocking else (),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            num_prompt=self.num_prompt,
            constraint=self.constraint,
        )
        if self.num_generated >= request.stopping.min_new_tokens:  # blocks nothing, even should a pending token drop
            self._row = row
        return row

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        """Tokens to compute before the next sample: placeholders of tokens in flight count (they are computed in
        the step after the one that samples them)."""
        return len(self.token_ids) + self.num_pending - self.num_computed

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt's log-probabilities are still to be computed: its request asks for them and its first
        token (whose output carries them) has not come. Until then it reads no cached KV: its whole prompt is computed,
        again from position 0 after a preemption."""
        return self.request.prompt_logprobs and self.first_token is None

    @property
    def ends_by_length(self) -> bool:
        """The tokens in flight take it to its length limit: no step after them is needed."""
        return self.num_pending > 0 and len(self.token_ids) + self.num_pending >= self.length_limit

    def ended(self, now: float) -> tuple[Usage, Timing]:
        """What it used, and its times, for a request that ends at `now` (before it ran, or before its first token,
        included)."""
        started = self.first_scheduled if self.first_scheduled is not None else now
        first = self.first_token if self.first_token is not None else now
        timing = Timing(started - self.arrival, first - self.arrival, now - self.arrival)
        return Usage(self.num_prompt, self.num_cached_prompt, self.num_generated), timing
