"""The drafter (spec/drafter.py): which decoding sequences verify which guesses each step, within each request's room
and the step's budget, as the load rule allows; and, through the engine, that a suffix tree learns an identity's
answers for that identity alone (the request's cache salt), so that what one tenant asked never becomes another's
drafts (the output would not change, but its acceptance, and so its latency, would depend on another tenant)."""

from __future__ import annotations

import json
import random

import pytest

from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.sched.sequence import Sequence
from llmserve.engine.spec.drafter import Drafter
from llmserve.engine.spec.policy import CostTable
from llmserve.engine.spec.suffix import available
from llmserve.engine.types.request import GenerationRequest, SamplingParams, StoppingParams
from tests.engine.engine_helpers import serve, table_rows
from tests.engine.spec.test_exactness import FREE, config, tiny64
from tests.testing import TINY_VOCAB


@pytest.fixture(scope="module")
def free_table(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("drafter") / "free.json"
    path.write_text(json.dumps({"rows": table_rows(FREE)}))
    return str(path)


def decoding(seq_no: int, prompt: list[int], generated: list[int], max_new: int = 64) -> Sequence:
    """A running sequence whose last token is sampled and not yet computed (one token to compute: it decodes)."""
    request = GenerationRequest(f"r{seq_no}", tuple(prompt), stopping=StoppingParams(max_new_tokens=max_new))
    seq = Sequence(request, [*prompt, *generated], 0.0, seq_no)
    seq.num_prompt = len(prompt)
    seq.num_computed = len(seq.token_ids) - 1
    return seq


LOOP = [5, 6, 7, 8, 9]


def test_no_drafts_before_the_step_cost_is_known_then_the_proposers_guess() -> None:
    seq = decoding(1, LOOP * 3, [5, 6])
    unmeasured = Drafter("ngram", 4, 512)
    assert unmeasured.drafts([seq], budget=64) == {}  # the warm-up's own steps: no choice of the rule's yet
    drafter = Drafter("ngram", 4, 512, FREE)
    assert drafter.drafts([seq], budget=64) == {1: [7, 8, 9, 5]}  # prompt lookup: what followed "5, 6" before


def test_drafts_stay_within_max_new_tokens_the_context_and_the_budget() -> None:
    drafter = Drafter("ngram", 8, 512, FREE)
    assert drafter.drafts([decoding(1, LOOP * 3, [5, 6], max_new=4)], budget=64) == {1: [7]}  # 2 left: 1 draft
    near_end = Drafter("ngram", 8, len(LOOP) * 3 + 4, FREE)  # the context: 2 positions past the tokens
    assert near_end.drafts([decoding(1, LOOP * 3, [5, 6])], budget=64) == {1: [7, 8]}
    assert drafter.drafts([decoding(1, LOOP * 3, [5, 6])], budget=0) == {}
    prefilling = decoding(1, LOOP * 3, [5, 6])
    prefilling.num_computed = 3  # a prompt chunk left to compute: it does not decode this step
    assert drafter.drafts([prefilling], budget=64) == {}


def test_the_calibration_forces_k_drafts_and_counts_nothing() -> None:
    drafter = Drafter("ngram", 8, 512)
    drafter.forced_k = 3
    seq = decoding(1, [1, 2, 3], [4])
    assert drafter.drafts([seq], budget=64) == {1: [4, 4, 4]}  # any tokens will do: the cost does not depend on them
    drafter.observe(1, 3, 3, 4)
    drafter.step_verified()
    assert (drafter.stats.steps, drafter.stats.proposed, drafter.stats.accepted) == (0, 0, 0)


def test_acceptance_is_counted_per_sequence_and_dropped_with_it() -> None:
    drafter = Drafter("ngram", 4, 512, FREE)
    seq = decoding(1, LOOP * 3, [5, 6])
    drafter.drafts([seq], budget=64)
    drafter.observe(1, 4, 2, 3)
    drafter.step_verified()
    stats = drafter.snapshot()
    assert (stats.steps, stats.proposed, stats.accepted, stats.emitted, stats.verifying) == (1, 4, 2, 3, 1)
    assert stats.k_counts == {4: 1} and stats.acceptance_rate == 0.5
    drafter.release(seq)
    drafter.observe(1, 4, 4, 5)  # a verification that lands after the sequence ended counts, its rate is gone
    assert drafter.stats.proposed == 8 and drafter._acceptance == {}


def test_a_cost_table_that_never_pays_drafts_nothing_and_says_so() -> None:
    dear = CostTable((1, 64), (0, 8), ((10.0, 1000.0), (10.0, 1000.0)))
    drafter = Drafter("ngram", 8, 512, dear)
    assert drafter.drafts([decoding(1, LOOP * 3, [5, 6])], budget=64) == {}
    assert drafter.stats.off_steps == 1


@pytest.mark.skipif(not available(), reason="arctic-inference is not installed (make install builds it)")
def test_an_identitys_answers_become_its_own_drafts_and_never_another_identitys(free_table: str) -> None:
    """Through the engine, greedy: alice asks, then bob asks the same, then alice again. Bob's drafts come from his
    own context only, so his speculation goes exactly as alice's first did; alice's second turn drafts her first
    answer, so a tree shared across identities would show in bob's counts."""
    core = EngineCore(tiny64(), config("suffix", free_table))
    prompt = random.Random(7).sample(range(TINY_VOCAB), 24)  # no repeats: little to draft from the prompt itself

    def counts(salt: str) -> tuple[int, int, int, int]:
        assert core.speculation is not None
        before = core.speculation.stats()
        request = GenerationRequest(
            salt,
            tuple(prompt),
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=48, ignore_eos=True),
            cache_salt=salt,
        )
        tokens = [t for delta in serve(core, request) for t in delta.token_ids]
        assert len(tokens) == 48
        after = core.speculation.stats()
        return (
            after.proposed - before.proposed,
            after.accepted - before.accepted,
            after.emitted - before.emitted,
            after.verifying - before.verifying,
        )

    alice = counts("alice")
    bob = counts("bob")
    again = counts("alice")
    assert bob == alice
    assert again[1] > alice[1]  # her own earlier answer: drafts accepted that her first turn could not have had
