"""Verification: speculative decoding through the real sampler gives the tokens it gives without speculation.

A toy language model (logits a fixed function of the last two tokens) stands in for the forward, so that a position's
logits are the same whether computed alone or as one of k + 1: what remains is the sampler's rule. Drafts are the
reference answer with tokens changed at random, so that every run mixes accepted and rejected drafts.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.engine.sample.sampler import sample
from llmserve.engine.sample.streams import RandomStreams, StreamMark
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.spec.verify import Verdict, accept, position_rows
from llmserve.engine.types.outputs import TokenLogprob
from llmserve.engine.types.request import SamplingParams

VOCAB = 48
KEY = 7


def toy_logits(context: list[int]) -> torch.Tensor:
    """Peaky logits that depend on the last two tokens only."""
    a, b = (context[-2:] if len(context) >= 2 else [0, *context])[-2:]
    g = torch.Generator().manual_seed(1 + a * VOCAB + b)
    return torch.randn(VOCAB, generator=g) * 3.0


def row_for(params: SamplingParams, context: list[int], num_prompt: int, blocked: tuple[int, ...] = ()) -> SampleRow:
    return SampleRow(params, params.seed, KEY, context, blocked, True, 2, num_prompt=num_prompt)


def reference(params: SamplingParams, prompt: list[int], n: int, min_new: int = 0) -> tuple[list[int], list]:
    """n tokens, one sampler call per token, as the engine samples without speculation."""
    streams = RandomStreams()
    context = list(prompt)
    logprobs = []
    for _ in range(n):
        blocked = (0, 1) if len(context) - len(prompt) < min_new else ()
        ids, lps = sample(toy_logits(context)[None], [row_for(params, context, len(prompt), blocked)], streams)
        context.append(ids[0])
        logprobs.append(lps[0])
    return context[len(prompt) :], logprobs


def speculative(
    params: SamplingParams, prompt: list[int], n: int, drafts_at, min_new: int = 0
) -> tuple[list[int], list, int]:
    """n tokens with drafts from `drafts_at(i)` verified k + 1 positions per sampler call; also the steps taken."""
    streams = RandomStreams()
    context = list(prompt)
    logprobs: list[TokenLogprob | None] = []
    steps = 0
    while len(context) - len(prompt) < n:
        generated = len(context) - len(prompt)
        drafts = drafts_at(generated)[: n - generated - 1]
        blocked = (0, 1) if generated < min_new else ()
        base = row_for(params, context, len(prompt), blocked)
        rows = position_rows(base, drafts, blocked_positions=max(0, min_new - generated))
        logits = torch.stack([toy_logits(context + drafts[:j]) for j in range(len(drafts) + 1)])
        mark = None if params.greedy else StreamMark(streams, base)
        picks, lps = sample(logits, rows, streams)
        verdict = accept(picks, drafts)
        if mark is not None:
            mark.settle(len(verdict.emitted))
        context.extend(verdict.emitted)
        logprobs.extend(lps[: len(verdict.emitted)])
        steps += 1
    return context[len(prompt) :], logprobs, steps


def corrupted(answer: list[int], k: int, flips: list[bool]):
    """Drafts: the answer's next k tokens, with the i-th proposed token changed where flips[i % len] says so."""
    counter = [0]

    def drafts_at(i: int) -> list[int]:
        out = []
        for t in answer[i : i + k]:
            flip = flips[counter[0] % len(flips)]
            counter[0] += 1
            out.append((t + 1) % VOCAB if flip else t)
        return out

    return drafts_at


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    top_k=st.sampled_from([0, 5, 20]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.05]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    presence_penalty=st.sampled_from([0.0, -0.4]),
    logit_bias=st.sampled_from([(), ((3, 2.0), (5, -1.5))]),
    seed=st.integers(0, 2**32),
)


@settings(max_examples=60, deadline=None)
@given(
    params=params_strategy,
    k=st.integers(1, 6),
    flips=st.lists(st.booleans(), min_size=1, max_size=7),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    min_new=st.sampled_from([0, 3]),
)
def test_speculation_emits_the_tokens_and_logprobs_of_plain_sampling(params, k, flips, prompt, min_new) -> None:
    n = 24
    expected, expected_lps = reference(params, prompt, n, min_new)
    got, got_lps, steps = speculative(params, prompt, n, corrupted(expected, k, flips), min_new)
    assert got == expected
    assert got_lps == expected_lps
    if not any(flips):  # every draft right: k + 1 tokens per step
        assert steps == math.ceil(n / (k + 1))


def test_greedy_with_perfect_drafts_takes_a_step_per_k_plus_one_tokens_and_bad_drafts_cost_no_token() -> None:
    params = SamplingParams()
    expected, _ = reference(params, [3, 4], 30)
    assert speculative(params, [3, 4], 30, corrupted(expected, 4, [False]))[2] == 6
    got, _, steps = speculative(params, [3, 4], 30, corrupted(expected, 4, [True]))
    assert got == expected and steps == 30  # every first draft wrong: one token per step, as without drafts


def test_a_sampled_stream_moves_on_by_the_emitted_positions_only() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    streams = RandomStreams()
    base = row_for(params, [1, 2], 2)
    mark = StreamMark(streams, base)
    sample(torch.randn(5, VOCAB), position_rows(base, [1, 2, 3, 4]), streams)  # draws 5
    mark.settle(2)
    again = RandomStreams()
    stream = again.stream(base)
    torch.rand((), generator=stream), torch.rand((), generator=stream)
    assert torch.equal(streams.stream(base).get_state(), stream.get_state())


def test_position_rows_read_the_drafts_before_each_position() -> None:
    params = SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=1)
    base = SampleRow(params, 1, KEY, [9, 8], (0, 1), False, 0, num_prompt=1)
    rows = position_rows(base, [5, 6], blocked_positions=1)
    assert [r.token_ids for r in rows] == [[9, 8], [9, 8, 5], [9, 8, 5, 6]]
    assert [r.blocked_token_ids for r in rows] == [(0, 1), (), ()]
    assert all(r.key == KEY and r.seed == 1 and r.num_prompt == 1 and r.constraint is None for r in rows)
    plain = position_rows(SampleRow(SamplingParams(), None, KEY, [9, 8], (), False, 0), [5, 6])
    assert all(r.token_ids is plain[0].token_ids for r in plain)  # nothing reads them: no copies


def test_accept_takes_the_longest_matching_prefix_and_the_next_pick() -> None:
    assert accept([4, 5, 6], [4, 5]) == Verdict([4, 5, 6], 2)
    assert accept([4, 9, 6], [4, 5]) == Verdict([4, 9], 1)
    assert accept([7, 5, 6], [4, 5]) == Verdict([7], 0)
    assert accept([7], []) == Verdict([7], 0)
    with pytest.raises(ValueError, match="need 3 picks for 2 drafts, got 2"):
        accept([4, 5], [4, 5])


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """The p-value of Pearson's chi-square test of `counts` against `probs` (chi2's survival function)."""
    total = sum(counts)
    stat = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_sampled_verification_follows_the_rejection_rule_over_many_seeds() -> None:
    """A draft t is accepted with probability p(t); on a rejection the token is drawn from p without t,
    renormalised; after an acceptance the bonus token is drawn from the next position's distribution."""
    vocab, draft, trials = 6, 2, 3000
    first = torch.tensor([0.5, 1.0, 1.2, -0.3, 0.0, 0.8])
    second = torch.tensor([1.5, -1.0, 0.3, 0.3, 0.0, -0.5])
    p1, p2 = torch.softmax(first, 0).tolist(), torch.softmax(second, 0).tolist()
    logits = torch.stack([first, second])
    firsts, bonus, rejected = [0] * vocab, [0] * vocab, [0] * vocab
    for seed in range(trials):
        base = SampleRow(SamplingParams(temperature=1.0, seed=seed), seed, KEY, [1], (), False, 0)
        picks, _ = sample(logits, position_rows(base, [draft]), RandomStreams())
        verdict = accept(picks, [draft])
        firsts[verdict.emitted[0]] += 1
        if verdict.accepted:
            bonus[verdict.emitted[1]] += 1
        else:
            rejected[verdict.emitted[0]] += 1
    accepted = firsts[draft]
    sd = math.sqrt(trials * p1[draft] * (1 - p1[draft]))
    assert abs(accepted - trials * p1[draft]) < 4 * sd  # accepted with probability p(t)
    assert chi_square_p(firsts, p1) > 1e-4  # the emitted token is distributed as without speculation
    assert chi_square_p(bonus, p2) > 1e-4
    residual = [0.0 if i == draft else p / (1 - p1[draft]) for i, p in enumerate(p1)]
    assert rejected[draft] == 0
    others = [i for i in range(vocab) if i != draft]
    assert chi_square_p([rejected[i] for i in others], [residual[i] for i in others]) > 1e-4
