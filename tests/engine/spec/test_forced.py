"""Grammar drafts and per-position masks, with llguidance over SmolLM2's real tokenizer.

`draft_bitmasks` (here: the engine masks each position through verify.grammar_positions) fills every position's mask
in one batched call of the library: an independent reference for what a position may take."""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import pytest
import torch

from llmserve.engine.sample.constraints import ConstraintCompiler, Vocabulary
from llmserve.engine.sample.masks import TokenMasks
from llmserve.engine.sample.sampler import sample
from llmserve.engine.sample.streams import RandomStreams, StreamMark
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.spec.forced import forced_tokens, grammar_drafts
from llmserve.engine.spec.verify import accept, position_rows
from llmserve.engine.types.request import ConstraintKind, ConstraintSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def draft_bitmasks(rows: Sequence[tuple[llguidance.LLMatcher, Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """The allowed tokens at every position of each (matcher, drafts) in `rows`: an int32 CPU bitmask
    [sum(len(drafts) + 1), ceil(vocab / 32)], sequence by sequence, position 0 (the state as it is) first.

    Positions after a draft the grammar refuses allow nothing (all bits clear): they are never accepted."""
    total = sum(len(drafts) + 1 for _, drafts in rows)
    bitmask = torch.zeros((total, (vocab_size + 31) // 32), dtype=torch.int32)
    work = []
    at = 0
    for matcher, drafts in rows:
        work.append((matcher, at, list(drafts)))
        at += len(drafts) + 1
    # Imported here: llguidance.torch compiles a kernel with torch.compile at import (seconds), which the engine's
    # own path (the drafter and the sampler) never needs.
    import llguidance.torch

    llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(llguidance.LLExecutor(), work, bitmask)
    return bitmask


@pytest.fixture(scope="module")
def compiled(smollm_tokenizer):
    vocab = len(smollm_tokenizer)
    compiler = ConstraintCompiler(Vocabulary(smollm_tokenizer, vocab, [smollm_tokenizer.eos_token_id]))
    yield compiler.submit(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))).result(), vocab
    compiler.close()


def fill_bitmask(states, vocab):
    return TokenMasks.shared().bitmask(states, vocab)


def additive_mask(bitmask, vocab, device):
    return TokenMasks.shared().additive(bitmask, vocab, device)


def answer_ids(tokenizer, matcher) -> list[int]:
    """A valid answer as the tokenizer spells it, checked against the grammar."""
    ids = tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    assert matcher.validate_tokens(ids) == len(ids)
    return ids


def test_forced_tokens_are_what_the_grammar_allows_alone_and_leave_the_state_as_it_was(compiled) -> None:
    template, vocab = compiled
    state = template.start()
    forced = forced_tokens(state.matcher, 8)
    assert forced  # '{"name": "' is forced by the schema
    for token in forced:
        mask = fill_bitmask([state], vocab)[0]
        allowed = [t for t in range(vocab) if mask[t // 32] >> (t % 32) & 1]
        assert token in allowed
        assert state.accept(token)
    assert forced_tokens(state.matcher, 8) == []  # now the name itself: a choice
    assert forced_tokens(template.start().matcher, 0) == []


def test_grammar_drafts_keep_the_forced_tokens_and_the_part_of_a_guess_the_grammar_allows(
    compiled, smollm_tokenizer
) -> None:
    template, _ = compiled
    state = template.start()
    ids = answer_ids(smollm_tokenizer, state.matcher)
    forced = forced_tokens(state.matcher, 16)
    assert ids[: len(forced)] == forced
    rest = ids[len(forced) :]
    close = smollm_tokenizer.encode("}", add_special_tokens=False)
    # rest[:4] is ' "', 'Ad', 'a', '",': the name's value; a "}" there would leave "age" out.
    drafts, n_forced = grammar_drafts(state.matcher, 16, rest[:4] + close * 2)
    assert n_forced == len(forced) and drafts == forced + rest[:4]
    assert grammar_drafts(state.matcher, 2, rest) == (forced[:2], 2)
    assert forced_tokens(state.matcher, 16) == forced  # the matcher is where it was
    assert not state.matcher.is_error()


def test_draft_bitmasks_are_the_masks_of_the_grammar_advanced_over_the_drafts(compiled, smollm_tokenizer) -> None:
    template, vocab = compiled
    state, other = template.start(), template.start()
    ids = answer_ids(smollm_tokenizer, state.matcher)
    assert other.accept(ids[0])
    bad = smollm_tokenizer.encode("}", add_special_tokens=False)[0]
    drafts = [ids[:6], ids[1:3] + [bad, ids[3]]]  # the second sequence's third draft ("}" after '{"name":') is refused
    masks = draft_bitmasks([(state.matcher, drafts[0]), (other.matcher, drafts[1])], vocab)
    assert masks.shape == (7 + 5, (vocab + 31) // 32)
    for j in range(7):  # position 0 first: the call left each matcher where it was
        expected = fill_bitmask([state], vocab)[0]
        assert torch.equal(masks[j], expected), j
        if j < 6:
            assert state.accept(drafts[0][j])
    for j in range(3):
        assert torch.equal(masks[7 + j], fill_bitmask([other], vocab)[0]), j
        if j < 2:
            assert other.accept(drafts[1][j])
    assert not masks[7 + 3].any() and not masks[7 + 4].any()  # after the refused draft: nothing allowed


def test_constrained_verification_with_position_masks_emits_what_constrained_sampling_emits(compiled) -> None:
    """Drafts verified with each position's mask from draft_bitmasks give the tokens the sampler gives with the
    request's grammar state one token at a time (greedy and seeded sampling, drafts partly wrong)."""
    template, vocab = compiled
    n, k = 24, 4

    def logits_at(context: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(context[-2:])) % 2**31)
        return torch.randn(vocab, generator=g) * 4.0

    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=5)):
        streams, state, context = RandomStreams(), template.start(), [1]
        while len(context) - 1 < n and not state.done:
            row = SampleRow(params, params.seed, 3, context, (), False, 0, num_prompt=1, constraint=state)
            ids, _ = sample(logits_at(context)[None], [row], streams)
            assert state.accept(ids[0])
            context.append(ids[0])
        expected = context[1:]

        streams, state, context, flips = RandomStreams(), template.start(), [1], 0
        while len(context) - 1 < len(expected) and not state.done:
            done = len(context) - 1
            drafts = list(expected[done : done + k])[: len(expected) - done - 1]
            flips += 1
            if drafts and flips % 3 == 0:
                drafts[-1] = (drafts[-1] + 1) % vocab  # a wrong guess now and then
            masks = additive_mask(draft_bitmasks([(state.matcher, drafts)], vocab), vocab, torch.device("cpu"))
            logits = torch.stack([logits_at(context + drafts[:j]) for j in range(len(drafts) + 1)]) + masks
            base = SampleRow(params, params.seed, 3, context, (), False, 0, num_prompt=1)
            mark = None if params.greedy else StreamMark(streams, base)
            picks, _ = sample(logits, position_rows(base, drafts), streams)
            verdict = accept(picks, drafts)
            if mark is not None:
                mark.settle(len(verdict.emitted))
            for token in verdict.emitted:
                assert state.accept(token)
                context.append(token)
                if state.done:
                    break
        assert context[1:] == expected
