"""Grammar drafts and per-position masks, with llguidance over SmolLM2's real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from llmserve.engine.constraints import ConstraintCompiler, fill_bitmask
from llmserve.engine.request import ConstraintKind, ConstraintSpec
from llmserve.engine.spec.forced import draft_bitmasks, forced_tokens, grammar_drafts

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiled(smollm_tokenizer):
    vocab = len(smollm_tokenizer)
    compiler = ConstraintCompiler(smollm_tokenizer, vocab, [smollm_tokenizer.eos_token_id])
    yield compiler.compile_now(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))), vocab
    compiler.close()


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
