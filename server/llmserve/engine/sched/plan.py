"""One step's plan: what the scheduler decided, in the form a backend reads.

The plan is the seam between book-keeping and tensors. The scheduler builds it once per step from its integer
books; a backend turns it into one forward and samples the rows that ask for it. Nothing here holds a tensor,
so plans are built and checked in tests without a model.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from llmserve.engine.sched.block_pool import BlockContent, Evicted
from llmserve.engine.sched.sequence import SampleRow, Sequence

NO_ADAPTER = -1  # SeqStep.lora_slot of a base-model sequence (lora.ops.NO_ADAPTER)


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a step: compute positions [start, start + len(token_ids)).

    `block_table` covers every position up to the last computed one; position p's K/V lives in slot
    `block_table[p // block_size] * block_size + p % block_size`. `sample` is set when the step computes the
    sequence's last token, whose logits pick the next one. `lora_slot` is the LoRA device slot whose adapter
    computes every one of its positions, drafts included (NO_ADAPTER: the base model).

    `drafts` (speculative decoding, spec/): guesses at the tokens after the last one, computed in the same step
    (`token_ids` is then [last token, *drafts]); every one of its positions is sampled, each with its row of
    `position_rows` (speculation gives them, spec/verify.py), and the longest prefix of drafts the sampler agrees
    with is accepted (`Scheduler.settle_drafts` keeps the books).
    """

    seq: Sequence  # the engine's state, for the book-keeping after the step; backends read the fields below
    start: int
    token_ids: Seq[int]
    block_table: Seq[int]
    sample: SampleRow | None
    drafts: Seq[int] = ()
    lora_slot: int = NO_ADAPTER
    position_rows: Seq[SampleRow] = ()

    @property
    def num_logits(self) -> int:
        """The rows of logits this entry needs: one per position verified, one for a plain sampling entry."""
        return 0 if self.sample is None else len(self.drafts) + 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def scored_positions(self) -> range | None:
        """For an entry of a request that asks for prompt logprobs (and has not had them yet): the positions of this
        step whose logits score the next prompt token, [start, min(end, prompt length - 1)) (empty in a chunk that
        only reads the prompt's last token); None for any other entry (and for one past its prompt)."""
        seq = self.seq
        if not seq.scores_prompt or self.start >= seq.num_prompt:  # past the prompt: a step planned ahead of its end
            return None
        return range(self.start, max(self.start, min(self.end, seq.num_prompt - 1)))

    @property
    def end(self) -> int:
        """The context length once the step is done."""
        return self.start + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    """The sequences of one step, in the scheduler's order, and the KV block copies to do before the forward.

    Each copy's source holds a reference until the step is accounted (`Scheduler.update` or `abandon`), so that
    nothing reallocates it first.

    With KV tiers: `offloads` are the cached blocks this schedule evicted, whose KV must be read out before the
    forward (which may overwrite them); `loads` are blocks to fill from a lower tier, each reported back with
    `Scheduler.load_done` (the sequences that wait for them stay in the queue until then).

    With LoRA: `lora_writes` are the adapters to copy into their device slots before the forward (slot, adapter),
    for the entries whose `lora_slot` names a slot that does not hold their adapter yet. The books carry the
    adapters (lora/adapters.LoraAdapter, a held adapter's payload) without reading them.
    """

    seqs: list[SeqStep] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    offloads: list[Evicted] = field(default_factory=list)
    loads: list[tuple[int, BlockContent]] = field(default_factory=list)
    lora_writes: list[tuple[int, object]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def sampling(self) -> list[SeqStep]:
        """The entries that sample a token this step, in plan order."""
        return [s for s in self.seqs if s.sample is not None]

    def sample_rows(self) -> list[SampleRow]:
        """The rows the step samples, one per row of logits it keeps, in plan order (the order of a backend's
        results): a sampling entry's row, or for an entry with drafts the row of each of its positions."""
        rows: list[SampleRow] = []
        for entry in self.seqs:
            if entry.sample is None:
                continue
            if not entry.drafts:
                rows.append(entry.sample)
            elif len(entry.position_rows) == len(entry.drafts) + 1:
                rows.extend(entry.position_rows)
            else:
                raise ValueError(f"sequence {entry.seq.seq_no}: {len(entry.drafts)} drafts without their position rows")
        return rows


@dataclass(slots=True, frozen=True)
class Pooled:
    """A pooling entry's result in place of a sampled token (the backend's, for an entry whose request has
    `pooling` and whose step reads its last prompt token): the finished vector, in plain floats."""

    values: list[float]


# A token the plan computes before it is known: the one a step still in flight samples for the same sequence
# (--async-scheduling). The step's worker puts the sampled id in its place before the forward (core/steps.py).
PENDING = -1


def step_of(seq: Sequence, n: int, drafts: Seq[int] = ()) -> SeqStep:
    """Seq's share of the plan: its next n tokens; it samples when they reach its last token. With drafts: its
    last token and the drafts (n = 1 + len(drafts)). Positions past its known tokens are PENDING (tokens in
    flight)."""
    start = seq.num_computed
    if drafts:
        return SeqStep(seq, start, [seq.token_ids[start], *drafts], seq.block_table, seq.sample_row(), drafts)
    end = start + n
    known = len(seq.token_ids)
    sample = seq.sample_row() if end == known + seq.num_pending else None
    token_ids = seq.token_ids[start:end]
    if end > known:
        token_ids.extend([PENDING] * (end - max(start, known)))
    return SeqStep(seq, start, token_ids, seq.block_table, sample)
