"""Verifying drafts: which of a sequence's k drafts the sampler accepts, from the logits of its k + 1 positions.

The rule is the sampler's own pick at every position. Position j of a sequence with drafts d_0..d_{k-1} is sampled
as the next token would be without speculation after d_0..d_{j-1}: `position_rows` gives each position a sample row
whose penalties read the tokens before it (the repetition penalty all of them, frequency and presence penalties
the generated ones, drafts included), whose blocked ids are those of that position (min_new_tokens counts the
drafts before it), and the same random stream. `sampler.sample` over those rows then picks t_j at each position,
and the longest prefix of drafts with d_j == t_j is accepted; the pick after it is emitted too (the correction, or
the bonus token after all k were accepted). So a sequence emits `accepted + 1` tokens, each the token the sampler
would have picked at that point without speculation.

Greedy rows pick the argmax: greedy output with speculation is greedy output without it (given the same logits).

Sampled rows pick by inverse CDF with one uniform draw per row from the sequence's stream, drawn in row order, so
position j gets the stream's j-th next number, which is the number the sampler without speculation would have drawn
for that token. Only the positions emitted may consume their draws: a `StreamMark` (sample/streams.py, had through
the backend's `mark_stream`) notes the stream before the sampler runs and `settle` rewinds it to just after the
emitted positions' draws. So a seeded request gives the same tokens with speculation as without, whatever was
drafted. For a draft-model-free (point-mass) draft this is the standard rejection rule: d_j is accepted with
probability p_j(d_j) (the uniform falls in d_j's share of the CDF), and on a rejection the pick is distributed as
p_j with d_j removed and renormalised (the uniform, given that it missed d_j's share, is uniform over the rest); the
output distribution is unchanged. tests/engine/spec checks both the replay (token for token, hypothesis over
sampling parameters and drafts) and the distribution (chi-square).

A constraint's mask at position j is the grammar's state after the first j drafts, not the state the row holds:
position j's row carries a copy of the grammar advanced over drafts[:j] (`grammar_positions`; the sampler fills every
row's mask in one batched call, as for any constrained row), and the request's own state is left as it was.

A verification is a use of the sampler, not a path of its own: speculation.py gives each position its row
(`SeqStep.position_rows`) before the forward and notes each sampled stream (`Verification.mark`); the backend samples
the plan's rows as it samples any (`StepPlan.sample_rows`); `Verification.verdicts` then reads each verifying
entry's span of those results, accepts, and rewinds its stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.engine.sample.constraints import ConstraintState
from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sample.streams import StreamMark
from llmserve.engine.sched.plan import SeqStep
from llmserve.engine.sched.sequence import GrammarState, SampleRow


@dataclass(slots=True, frozen=True)
class Verdict:
    """One sequence's outcome: `emitted` (the accepted drafts, then the sampler's own token) and how many drafts
    were accepted (`len(emitted) - 1`)."""

    emitted: list[int]
    accepted: int


class Verification:
    """A step's verifying entries' random streams as they were before the sampler drew (`mark`), and the reading of
    the step's results by entry (`verdicts`)."""

    __slots__ = ("_marks",)

    def __init__(self) -> None:
        self._marks: dict[int, StreamMark] = {}

    def mark(self, row: SampleRow, mark: StreamMark) -> None:
        """Note a sampled verifying row's stream before the sampler draws for its positions (the backend's
        `mark_stream`)."""
        self._marks[row.key] = mark

    def verdicts(
        self, entries: Sequence[SeqStep], results: Sequence[Sampled | RowFailed]
    ) -> list[tuple[SeqStep, Sampled | RowFailed | Verified]]:
        """Each sampling entry's result, from the step's results (`entry.num_logits` each, in order): a plain entry
        its Sampled (or RowFailed), an entry with drafts its Verified (or RowFailed when any position failed). A
        verified sampled stream is left as if only the emitted positions had drawn."""
        out: list[tuple[SeqStep, Sampled | RowFailed | Verified]] = []
        at = 0
        for entry in entries:
            span = results[at : at + entry.num_logits]
            at += entry.num_logits
            if not entry.drafts:
                out.append((entry, span[0]))
                continue
            failed = next((r for r in span if isinstance(r, RowFailed)), None)
            if failed is not None:
                out.append((entry, failed))
                continue
            samples = [r for r in span if isinstance(r, Sampled)]
            verdict = accept([r.token_id for r in samples], entry.drafts)
            mark = self._marks.get(entry.seq.seq_no)
            if mark is not None:
                mark.settle(len(verdict.emitted))
            out.append((entry, Verified(samples[: verdict.accepted + 1], verdict.accepted)))
        if at != len(results):
            raise ValueError(f"{len(results)} results for {at} rows of logits")
        return out


@dataclass(slots=True, frozen=True)
class Verified:
    """A verifying entry's result: the tokens it emits (the accepted drafts, then the sampler's own pick), each
    with its logprobs, and how many drafts were accepted."""

    samples: list[Sampled]
    accepted: int


def grammar_positions(state: GrammarState, drafts: Sequence[int]) -> list[GrammarState]:
    """The grammar's state at each position of a verification: the request's own state at position 0, then copies
    advanced over drafts[:j]. Past a draft the grammar refuses, the last good state repeats (those positions can
    never be accepted, since the pick before them differs from the draft)."""
    states: list[GrammarState] = [state]
    current = state.matcher
    for token in drafts:
        following = current.deep_copy()
        if not following.consume_token(token):
            states.extend([states[-1]] * (len(drafts) + 1 - len(states)))
            break
        current = following
        states.append(ConstraintState(following))
    return states


def position_rows(row: SampleRow, drafts: Sequence[int], *, blocked_positions: int = 0) -> list[SampleRow]:
    """The sample rows of positions 0..len(drafts) of a sequence whose next-token row is `row`.

    Row j reads `row.token_ids` followed by drafts[:j] (a new list only where a penalty reads the tokens); the first
    `blocked_positions` rows keep `row.blocked_token_ids` (min_new_tokens - tokens generated: the drafts before a
    position count as generated), later ones block nothing. Every row names the same random stream. The rows carry
    no constraint: position masks come from the grammar advanced over the drafts (grammar_positions)."""
    params = row.params
    reads_tokens = params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
    rows = []
    for j in range(len(drafts) + 1):
        token_ids = list(row.token_ids) + list(drafts[:j]) if reads_tokens and j else row.token_ids
        blocked = row.blocked_token_ids if j < blocked_positions else ()
        rows.append(dataclasses.replace(row, token_ids=token_ids, blocked_token_ids=blocked, constraint=None))
    return rows


def accept(picks: Sequence[int], drafts: Sequence[int]) -> Verdict:
    """The longest prefix of `drafts` that equals the sampler's `picks` (len(drafts) + 1 of them), and the pick
    after it."""
    if len(picks) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} picks for {len(drafts)} drafts, got {len(picks)}")
    m = 0
    while m < len(drafts) and picks[m] == drafts[m]:
        m += 1
    return Verdict(list(picks[: m + 1]), m)
