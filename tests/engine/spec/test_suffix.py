"""Suffix decoding over Arctic Inference's suffix trees: the request's own context, its identity's recent answers,
never another identity's, within the bounds."""

from __future__ import annotations

import pytest

from llmserve.engine.spec.suffix import SuffixConfig, SuffixProposer, available

pytestmark = pytest.mark.skipif(not available(), reason="arctic-inference is not installed (make install builds it)")

ANSWER = [50, 51, 52, 53, 54, 55, 56, 57]


def answers_of(proposer: SuffixProposer, salt: str | None) -> int:
    """How many answers the identity's tree holds (0 for an unknown one)."""
    identity = proposer._identities.get(salt)
    return 0 if identity is None else len(identity.answers)


def answer(proposer: SuffixProposer, key: int, salt: str | None, prompt: list[int], output: list[int]) -> None:
    """A request that was sent `output`, token by token as the engine would feed it."""
    proposer.start(key, salt, prompt)
    tokens = list(prompt)
    for token in output:
        proposer.propose(key, tokens)
        tokens.append(token)
    proposer.release(key, tokens)


def test_a_request_gets_drafts_from_its_own_context() -> None:
    context = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    proposer = SuffixProposer(SuffixConfig(k=4))  # max_spec_factor 4: up to 4x the match's length
    proposer.start(1, None, context)
    assert proposer.propose(1, context) == [4, 5, 6, 9]
    assert proposer.propose(1, [*context, 4, 5], k=2) == [6, 9]
    short = SuffixProposer(SuffixConfig(k=4, max_spec_factor=1.0))  # Arctic's default: at most the match's length
    short.start(1, None, context)
    assert short.propose(1, context) == [4, 5, 6]


def test_answers_are_shared_within_an_identity_and_never_across() -> None:
    proposer = SuffixProposer(SuffixConfig(k=4))
    answer(proposer, 1, "tenant-a", [7, 7, 7], ANSWER)
    for key, salt in ((2, "tenant-b"), (3, None)):
        proposer.start(key, salt, [8, 8])
        assert proposer.propose(key, [8, 8, 50, 51, 52, 53]) == []  # tenant-a's answer is not theirs
    proposer.start(4, "tenant-a", [8, 8])
    assert proposer.propose(4, [8, 8, 50, 51, 52, 53]) == [54, 55, 56, 57]
    assert answers_of(proposer, "tenant-a") == 2 and answers_of(proposer, "tenant-b") == 1


def test_an_answers_last_tokens_are_kept_when_it_ends() -> None:
    proposer = SuffixProposer(SuffixConfig(k=4))
    proposer.start(1, None, [7])
    proposer.release(1, [7, *ANSWER])  # never proposed for: the whole answer arrives at the end
    proposer.start(2, None, [9])
    assert proposer.propose(2, [9, 53, 54, 55]) == [56, 57]


def test_each_identity_keeps_its_latest_answers_only() -> None:
    proposer = SuffixProposer(SuffixConfig(k=4, max_answers=3))
    answer(proposer, 1, None, [7], ANSWER)
    answer(proposer, 2, None, [7], [60, 61, 62, 63, 64])
    answer(proposer, 3, None, [7], [70, 71, 72, 73, 74])
    proposer.start(4, None, [9])  # its answer takes the place of the oldest, the first
    assert answers_of(proposer, None) == 3
    assert proposer.propose(4, [9, 60, 61, 62]) == [63, 64]
    assert proposer.propose(4, [9, 60, 61, 62, 50, 51, 52]) == []


def test_the_least_recently_used_idle_identity_is_dropped_first() -> None:
    proposer = SuffixProposer(SuffixConfig(k=4, max_identities=2))
    answer(proposer, 1, "a", [7], ANSWER)
    proposer.start(2, "b", [7])  # b stays live
    answer(proposer, 3, "c", [7], ANSWER)  # three identities: a, idle and least recently used, goes
    assert len(proposer._identities) == 2 and answers_of(proposer, "a") == 0 and answers_of(proposer, "b") == 1
    answer(proposer, 4, "d", [7], ANSWER)  # b is live, so c goes even though b is older
    assert answers_of(proposer, "b") == 1 and answers_of(proposer, "c") == 0 and answers_of(proposer, "d") == 1
    assert proposer.propose(2, [7, 50, 51]) == []  # b never saw the others' answers
    proposer.release(2)
    assert len(proposer) == 0


def test_misuse_is_refused_or_harmless() -> None:
    proposer = SuffixProposer()
    proposer.start(1, None, [1, 2])
    with pytest.raises(ValueError, match="sequence 1 is already started"):
        proposer.start(1, None, [1, 2])
    assert proposer.propose(99, [1, 2]) == []  # never started
    proposer.release(99)
    with pytest.raises(ValueError, match="must be >= 1"):
        SuffixConfig(max_answers=0)
