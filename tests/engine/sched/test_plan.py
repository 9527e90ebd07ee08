"""One step's plan (sched/plan.py), over integers: a sequence's share of a step (`step_of`: a prompt chunk, the
position that samples, placeholders for tokens in flight, drafts), and the rows the step samples, in the order a
backend returns its results (`StepPlan.sample_rows`)."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.engine.sched.plan import PENDING, StepPlan, step_of
from llmserve.engine.sched.sequence import Sequence
from llmserve.engine.types.request import GenerationRequest, StoppingParams


def sequence(seq_no: int, tokens: list[int], computed: int) -> Sequence:
    request = GenerationRequest(f"r{seq_no}", tuple(tokens), stopping=StoppingParams(max_new_tokens=8))
    seq = Sequence(request, list(tokens), 0.0, seq_no)
    seq.num_computed = computed
    seq.block_table = [3, 4]
    return seq


def test_a_prompt_chunk_samples_only_when_it_reaches_the_last_token() -> None:
    seq = sequence(1, list(range(10, 30)), computed=4)
    chunk = step_of(seq, 8)
    assert (chunk.start, list(chunk.token_ids), chunk.sample, chunk.end) == (4, list(range(14, 22)), None, 12)
    assert chunk.num_logits == 0 and chunk.block_table is seq.block_table
    last = step_of(seq, 16)
    assert last.sample is not None and last.num_logits == 1 and last.end == 20


def test_tokens_in_flight_are_computed_as_placeholders() -> None:
    seq = sequence(1, [5, 6, 7], computed=3)
    seq.num_pending = 1  # the step in flight samples token 3
    entry = step_of(seq, 1)
    assert list(entry.token_ids) == [PENDING] and entry.sample is not None
    assert entry.token_ids is not seq.token_ids  # the worker fills it in: never the sequence's own list


def test_drafts_follow_the_last_token_and_each_position_samples() -> None:
    seq = sequence(1, [5, 6, 7], computed=2)
    entry = step_of(seq, 3, [8, 9])
    assert list(entry.token_ids) == [7, 8, 9] and list(entry.drafts) == [8, 9] and entry.num_logits == 3


def test_the_rows_a_step_samples_are_one_per_kept_row_of_logits_in_plan_order() -> None:
    plain, chunk, drafted = sequence(1, [1, 2], 1), sequence(2, list(range(20)), 0), sequence(3, [5, 6, 7], 2)
    draft = step_of(drafted, 3, [8, 9])
    assert draft.sample is not None
    positions = [dataclasses.replace(draft.sample, token_ids=[5, 6, 7, *[8, 9][:j]]) for j in range(3)]
    plan = StepPlan([step_of(plain, 1), step_of(chunk, 4), draft])
    with pytest.raises(ValueError, match="2 drafts without their position rows"):
        plan.sample_rows()  # speculation gives a verifying entry its rows before the backend runs
    draft.position_rows = positions
    rows = plan.sample_rows()
    assert [row.key for row in rows] == [1, 3, 3, 3] and rows[1:] == positions
    assert [entry.seq.seq_no for entry in plan.sampling] == [1, 3]
