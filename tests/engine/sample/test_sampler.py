"""Tests for llmserve.engine.sample.sampler: greedy exactness, per-request seeds, warpers against transformers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llmserve.engine.sample import sampler
from llmserve.engine.sample.sampler import (
    RowFailed,
    Sampled,
    SampleRow,
    _apply_repetition_penalty,
    nucleus_floor,
    warped_weights,
)
from llmserve.engine.sample.streams import RandomStreams
from llmserve.engine.types.outputs import TokenLogprob
from llmserve.engine.types.request import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


GREEDY = SamplingParams()


_keys = itertools.count()  # each row its own sequence, hence its own stream


def row(
    params: SamplingParams = GREEDY,
    seed: int | None = None,
    *,
    token_ids: tuple[int, ...] = (),
    blocked: tuple[int, ...] = (),
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> SampleRow:
    seed = None if params.greedy else (0 if seed is None else seed)
    return SampleRow(params, seed, next(_keys), list(token_ids), list(blocked), logprobs, top_logprobs)


def sample(
    logits: torch.Tensor, rows: list[SampleRow], streams: RandomStreams | None = None
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The sampler with streams that start afresh, unless `streams` is given: a row's draws then go on from
    one call to the next, as a sequence's do from step to step."""
    return sampler.sample(logits, rows, RandomStreams(logits.device) if streams is None else streams)


def sample_each(logits: torch.Tensor, rows: list[SampleRow]) -> list[Sampled | RowFailed]:
    return sampler.sample_each(logits, rows, RandomStreams(logits.device))


def hf_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warper chain for one row of logits, as `generate` orders it."""
    scores = logits.clone().unsqueeze(0)
    scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return scores.squeeze(0)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_k=st.sampled_from([0, 0, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 1.0, 0.5, 0.9, 0.99]),
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.3, 0.8]),
)


# --- greedy -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_even_with_ties(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000).to(dtype).to(device)
    logits[3, 10] = logits[3, 500] = 100.0  # a tie: the first index wins, as in transformers' argmax
    ids, logprobs = sample(logits, [row() for _ in range(16)])
    values = logits.float().cpu().tolist()
    # An independent reference: the largest value, the lowest index among equals.
    assert ids == [max(range(len(v)), key=lambda j, v=v: (v[j], -j)) for v in values]
    assert ids[3] == 10
    assert logprobs == [None] * 16


def test_greedy_with_penalty_and_blocked_ids_matches_transformers() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    history = [[1, 2, 3, 3], [5], [], [7, 8]]
    rows = [row(SamplingParams(repetition_penalty=1.5), token_ids=tuple(h), blocked=(9,)) for h in history]
    ids, _ = sample(logits, rows)
    for i, h in enumerate(history):
        scores = logits[i : i + 1].clone()
        if h:
            scores = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([h]), scores)
        scores[0, 9] = -math.inf
        assert ids[i] == int(scores.argmax())


@pytest.mark.parametrize("penalty", [1.3, 2.0])
def test_greedy_with_a_penalty_alone_matches_transformers(penalty: float) -> None:
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    history = [[int(i) for i in logits[r].topk(3).indices] for r in range(3)]  # penalise the current favourites
    ids, _ = sample(logits, [row(SamplingParams(repetition_penalty=penalty), token_ids=tuple(h)) for h in history])
    for i, h in enumerate(history):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([h]), logits[i : i + 1].clone()).argmax()
        assert ids[i] == int(expected)


def test_half_precision_logits_are_warped_and_drawn_in_float32() -> None:
    logits = (torch.randn(64, 300, generator=torch.Generator().manual_seed(4)) * 4).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02)
    ours, _ = sample(logits, [row(params, seed) for seed in range(64)])
    reference, _ = sample(logits.float(), [row(params, seed) for seed in range(64)])
    assert ours == reference


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(3, 100)
    before = logits.clone()
    sample(logits, [row(SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.2), 1, token_ids=(1, 2))] * 3)
    assert torch.equal(logits, before)
    logits[0, :3] = torch.tensor([math.inf, math.nan, 1.0])  # a row with every token blocked is read again, tamed
    before = logits.clone()
    sample(logits[:1, :3], [row(SamplingParams(temperature=0.7), 1, blocked=(0, 1, 2))])
    torch.testing.assert_close(logits, before, rtol=0, atol=0, equal_nan=True)


# --- seeds ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=params_strategy.filter(lambda p: not p.greedy),
    others=st.lists(params_strategy, min_size=0, max_size=6),
    position=st.integers(0, 6),
    seed=st.integers(0, 2**63 - 1),
    vocab=st.sampled_from([7, 100, 3000]),
    ties=st.booleans(),
    data_seed=st.integers(0, 1000),
)
def test_same_seed_same_tokens_whatever_the_batch(
    device, target, others, position, seed, vocab, ties, data_seed
) -> None:
    gen = torch.Generator().manual_seed(data_seed)
    steps = 4
    logits = torch.randn(steps, len(others) + 1, vocab, generator=gen) * 3
    if ties:  # bfloat16 logits, as CUDA serving produces, have many exact ties
        logits = logits.bfloat16().float()
    logits = logits.to(device)
    history = (1, 2, 2, 5)
    position = min(position, len(others))

    alone, streams = row(target, seed, token_ids=history), RandomStreams(device)
    alone_ids = [sample(logits[s, position : position + 1], [alone], streams)[0][0] for s in range(steps)]

    batched = row(target, seed, token_ids=history)
    batch_rows = [row(p, i, token_ids=(3,), blocked=(0,)) for i, p in enumerate(others)]
    batch_rows.insert(position, batched)
    streams = RandomStreams(device)
    batch_ids = [sample(logits[s], batch_rows, streams)[0][position] for s in range(steps)]
    assert batch_ids == alone_ids


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_at_full_vocab(device: str) -> None:
    torch.manual_seed(2)
    logits = (torch.randn(8, 49152) * 4).to(device)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=0, min_p=0.01, repetition_penalty=1.1)
    alone = [sample(logits[i : i + 1], [row(params, 42, token_ids=(5, 6))])[0][0] for i in range(8)]
    batch = sample(logits, [row(params, 42, token_ids=(5, 6)) for _ in range(8)])[0]
    assert batch == alone


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    ids = {sample(logits, [row(SamplingParams(temperature=1.0), s)])[0][0] for s in range(20)}
    assert len(ids) > 10


def test_the_draw_comes_from_the_rows_own_generator() -> None:
    """Eight equal logits: the CDF steps are exact (k/8), so the token is floor(8u) for the first uniform the
    row's generator gives, whatever the global RNG does in between."""
    logits = torch.zeros(1, 8)
    for seed in range(32):
        u = torch.rand((), generator=torch.Generator().manual_seed(seed)).item()
        torch.manual_seed(1000 + seed)  # a sampler drawing from the global RNG would follow this instead
        assert sample(logits, [row(SamplingParams(temperature=1.0), seed)])[0] == [int(8 * u)]


def test_sampled_row_without_a_seed_raises() -> None:
    bad = SampleRow(SamplingParams(temperature=1.0), None, 5, [], [], False, 0)
    with pytest.raises(ValueError, match="sequence 5: sampled .* without a seed"):
        sample(torch.zeros(1, 10), [bad])


def test_sample_each_samples_the_batch_at_once_or_fails_a_bad_row_alone(caplog) -> None:  # noqa: ANN001
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    rows = [row(), row(SamplingParams(temperature=1.0), 7, logprobs=True, top_logprobs=2), row()]
    expected_ids, expected_lps = sample(
        logits, [row(), row(SamplingParams(temperature=1.0), 7, logprobs=True, top_logprobs=2), row()]
    )
    with caplog.at_level("ERROR", logger="llmserve.engine.sample.sampler"):
        results = sample_each(logits, rows)
    assert not caplog.records  # sampled at once: no fallback to row by row
    assert [r.token_id for r in results] == expected_ids
    assert results[0].logprob is None and results[1].logprob == expected_lps[1] and len(results[1].logprob.top) == 2
    bad = SampleRow(SamplingParams(temperature=0.5), None, 99, [], [], False, 0)
    rows = [row(logprobs=True), bad, row(SamplingParams(temperature=1.0), 7)]
    results = sample_each(logits, rows)
    assert results[0] == Sampled(int(logits[0].argmax()), sample(logits[:1], [row(logprobs=True)])[1][0])
    assert results[1] == RowFailed("sampling failed: ValueError: sequence 99: sampled (temperature 0.5) without a seed")
    assert results[2] == Sampled(sample(logits[2:], [row(SamplingParams(temperature=1.0), 7)])[0][0], None)


@pytest.mark.parametrize(("u", "expected"), [(0.0, 1), (0.45, 1), (0.55, 2), (1.0, 2)])
def test_the_draw_is_the_inverse_cdf_of_the_kept_weights(monkeypatch, u: float, expected: int) -> None:  # noqa: ANN001
    """min_p leaves weights [0, .4, .4, 0] (total .8): u picks the first token whose running weight exceeds u * .8,
    never a token without weight, also at u = 0 and where u * total rounds up to the total."""
    import llmserve.engine.sample.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "_uniform", lambda generator, device: torch.tensor(u))
    logits = torch.tensor([[0.1, 0.4, 0.4, 0.1]]).log()
    assert sample(logits, [row(SamplingParams(temperature=1.0, min_p=0.6), 0)])[0] == [expected]


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 10), [row()])


# --- warpers ----------------------------------------------------------------------------------------------


def test_top_k_one_and_tiny_top_p_and_min_p_one_are_greedy() -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 5000) * 2
    greedy = logits.argmax(dim=-1).tolist()
    for params in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=2.0, min_p=1.0),
    ):
        for seed in range(5):
            assert sample(logits, [row(params, seed + i) for i in range(8)])[0] == greedy


@settings(max_examples=80, deadline=None)
@given(
    params=params_strategy.filter(lambda p: not p.greedy),
    scale=st.sampled_from([0.5, 3.0, 10.0]),
    vocab=st.sampled_from([50, 2000]),
    data_seed=st.integers(0, 10_000),
)
def test_warped_distribution_matches_transformers(params, scale, vocab, data_seed) -> None:
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(data_seed)) * scale
    ours = warped_weights(logits.clone(), [params])[0]
    theirs = torch.softmax(hf_warp(logits[0], params), dim=-1)
    # Kept sets may only differ on exact ties at a cut, which random floats do not produce.
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours / ours.sum(), theirs, rtol=1e-4, atol=1e-6)


def test_nucleus_stops_where_the_mass_before_a_token_reaches_top_p() -> None:
    """As transformers' TopPLogitsWarper: with probabilities .5 .25 .25 and top_p .5 the nucleus is the first token
    alone (the mass before the second is exactly top_p)."""
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]])
    assert nucleus_floor(probs, torch.tensor([[0.5], [0.5]])).flatten().tolist() == [0.5, 0.5]
    assert nucleus_floor(probs, torch.tensor([[0.75], [0.5000001]])).flatten().tolist() == [0.25, 0.25]
    # Also where the candidates fall short and the whole row is sorted: .5 + .25 + .125 is exactly .875.
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]])
    assert nucleus_floor(probs, torch.tensor([[0.875]])).item() == 0.125


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([2, 10, 500, 49152]),
    scale=st.sampled_from([0.1, 1.0, 5.0, 30.0]),
    top_p=st.floats(0.01, 0.999),
    ties=st.booleans(),
    data_seed=st.integers(0, 10_000),
)
def test_nucleus_floor_cpu_candidates_equal_a_full_sort(rows, vocab, scale, top_p, ties, data_seed) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(data_seed)) * scale
    if ties:
        logits = logits.bfloat16().float()
    probs = torch.softmax(logits, dim=-1)
    ps = torch.full((rows, 1), top_p)
    ordered = probs.sort(dim=-1, descending=True).values
    before = torch.cat([torch.zeros(rows, 1, dtype=torch.float64), ordered.double().cumsum(dim=-1)[:, :-1]], dim=1)
    expected = ordered.gather(1, (before < ps).sum(dim=-1, keepdim=True) - 1)
    assert torch.equal(nucleus_floor(probs, ps), expected)


def test_top_p_matches_transformers_on_real_shaped_logits() -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 49152) * 3
    for top_p in (0.5, 0.9, 0.95):
        ours = warped_weights(logits.clone(), [SamplingParams(temperature=1.0, top_p=top_p)] * 4) > 0
        theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
        # Over thousands of kept tokens, float32 softmax's rounding of the total (~1e-6) can move the cut
        # by one token either way; anything more would be a real disagreement.
        assert (ours != theirs).sum(dim=-1).max() <= 1


def test_min_p_keeps_only_tokens_near_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    params = SamplingParams(temperature=1.0, min_p=0.25)  # keeps p >= 0.125: tokens 0 and 1
    seen = {sample(logits, [row(params, s)])[0][0] for s in range(200)}
    assert seen == {0, 1}


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 100) * 3
    logits[0, 1], logits[1, 2], logits[2, 50] = 0.5, 1.0, -0.25  # seen logits in (0, 1] are divided too
    histories = [[1, 5, 5, 99, 0], [2], [50, 51, 52]]
    penalties = [1.3, 0.7, 2.0]
    rows = [
        row(SamplingParams(repetition_penalty=p), token_ids=tuple(h)) for h, p in zip(histories, penalties, strict=True)
    ]
    ours = logits.clone()
    _apply_repetition_penalty(ours, rows)
    for i, (h, p) in enumerate(zip(histories, penalties, strict=True)):
        theirs = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([h]), logits[i : i + 1].clone())
        assert torch.equal(ours[i : i + 1], theirs)


def test_blocked_ids_are_never_chosen() -> None:
    torch.manual_seed(6)
    logits = torch.randn(1, 20)
    blocked = tuple(logits[0].topk(3).indices.tolist())
    for params in (SamplingParams(), SamplingParams(temperature=5.0), SamplingParams(temperature=1.0, top_k=4)):
        for seed in range(100):
            token = sample(logits, [row(params, seed, blocked=blocked)])[0][0]
            assert token not in blocked


def test_temperature_sampling_frequencies_follow_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]])
    temperature = 0.8
    expected = torch.softmax(logits[0] / temperature, dim=-1)
    n = 20_000
    # One row per draw, each with its own seed, as the engine would give independent requests.
    rows = [row(SamplingParams(temperature=temperature), seed) for seed in range(n)]
    ids, _ = sample(logits.expand(n, -1), rows)
    counts = torch.bincount(torch.tensor(ids), minlength=8).double()
    chi2 = float(((counts - n * expected.double()) ** 2 / (n * expected.double())).sum())
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def test_top_k_sampling_only_picks_from_the_top_k_in_proportion() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    n = 10_000
    rows = [row(SamplingParams(temperature=1.0, top_k=2), seed) for seed in range(n)]
    ids, _ = sample(logits.expand(n, -1), rows)
    counts = torch.bincount(torch.tensor(ids), minlength=5)
    assert counts[2:].sum() == 0
    assert abs(counts[0].item() / n - 1 / (1 + math.exp(-1))) < 0.02


# --- logprobs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_sorted_top(device: str) -> None:
    torch.manual_seed(7)
    logits = (torch.randn(3, 400) * 2).to(device)
    rows = [
        row(SamplingParams(), logprobs=True, top_logprobs=5),
        row(SamplingParams(temperature=0.5, repetition_penalty=1.5), 3, token_ids=(1, 2)),
        row(
            SamplingParams(temperature=2.0, top_k=10),
            4,
            logprobs=True,
            top_logprobs=20,
            blocked=(0,),
        ),
    ]
    ids, logprobs = sample(logits, rows)
    reference = torch.log_softmax(logits.float().cpu(), dim=-1)
    assert logprobs[1] is None
    for i in (0, 2):
        lp = logprobs[i]
        assert lp is not None and lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(reference[i, ids[i]].item(), abs=1e-5)
        assert len(lp.top) == rows[i].top_logprobs
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for token, value in lp.top:
            assert value == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert lp.top[0][0] == int(reference[i].argmax())


def test_logprobs_without_top() -> None:
    logits = torch.randn(1, 50)
    _, logprobs = sample(logits, [row(logprobs=True)])
    assert logprobs[0] is not None and logprobs[0].top == []
    ids, logprobs = sample(logits, [row(logprobs=True, top_logprobs=1)])
    assert [t for t, _ in logprobs[0].top] == ids and logprobs[0].top[0][1] == logprobs[0].logprob


# --- extreme but valid values ------------------------------------------------------------------------------

# Values that pass SamplingParams.validate and sit at or past float32's range: each must be served.
extreme_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 5e-324, 1e-46, 1e-6, 1e-5, 0.01, 1.0, 1e6, 1e30, 1e300, 1.7e308]),
    top_k=st.sampled_from([0, 1, 2, 49151, 2**31 - 1]),
    top_p=st.sampled_from([1.0, 1e-46, 5e-324, 1e-38, 1e-7, 0.5, 1.0 - 1e-12]),
    min_p=st.sampled_from([0.0, 5e-324, 1e-30, 0.5, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 5e-324, 1e-46, 1e-7, 1e7, 1e46, 1.7e308]),
)
logit_rows = st.sampled_from(["normal", "ties", "all_neg_inf", "one_finite", "huge", "all_blocked"])


def _extreme_logits(kind: str, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One row of logits of the given kind, and the ids to block in it."""
    x = torch.randn(vocab, generator=gen) * 3
    blocked: tuple[int, ...] = ()
    if kind == "ties":
        x = torch.zeros(vocab)
    elif kind == "all_neg_inf":
        x = torch.full((vocab,), float("-inf"))
    elif kind == "one_finite":
        x = torch.full((vocab,), float("-inf"))
        x[vocab // 2] = 1.0
    elif kind == "huge":
        x = x * 1e37  # finite in float32, but overflows when divided by a small temperature
    elif kind == "all_blocked":
        blocked = tuple(range(vocab))
    return x, blocked


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    extreme=extreme_params,
    kind=logit_rows,
    normals=st.lists(params_strategy, min_size=1, max_size=4),
    position=st.integers(0, 4),
    vocab=st.sampled_from([8, 3000]),
    data_seed=st.integers(0, 1000),
    logprobs=st.booleans(),
)
def test_extreme_values_are_served_and_leave_the_other_rows_alone(
    extreme, kind, normals, position, vocab, data_seed, logprobs
) -> None:
    gen = torch.Generator().manual_seed(data_seed)
    normal_logits = torch.randn(len(normals), vocab, generator=gen) * 3
    odd, blocked = _extreme_logits(kind, vocab, gen)
    position = min(position, len(normals))
    logits = torch.cat([normal_logits[:position], odd[None], normal_logits[position:]])
    history = (1, 2, vocab - 1)

    def normal_rows() -> list[SampleRow]:
        return [row(p, i, token_ids=history) for i, p in enumerate(normals)]

    alone = sample(normal_logits, normal_rows())[0]
    rows = normal_rows()
    rows.insert(position, row(extreme, 7, token_ids=history, blocked=blocked, logprobs=logprobs, top_logprobs=3))
    ids, lps = sample(logits, rows)
    assert ids[:position] + ids[position + 1 :] == alone  # the others get exactly their own tokens
    chosen = ids[position]
    assert 0 <= chosen < vocab
    finite = torch.isfinite(odd)
    if finite.any() and kind != "all_blocked":
        assert finite[chosen]  # never a token the model ruled out while others are left
    if logprobs:
        assert lps[position] is not None and lps[position].token_id == chosen


def test_tiny_top_p_and_temperature_act_as_greedy_and_huge_temperature_as_uniform() -> None:
    """The documented equivalents: top_p below float32's range keeps the best token, a temperature below
    MIN_TEMPERATURE is greedy (no generator needed), one past MAX_TEMPERATURE draws uniformly."""
    torch.manual_seed(4)
    logits = torch.randn(4, 500) * 2
    best = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(temperature=1.0, top_p=1e-46), SamplingParams(temperature=1.0, top_p=5e-324)):
        assert sample(logits, [row(params, s) for s in range(4)])[0] == best
    tiny = SamplingParams(temperature=1e-46)
    assert tiny.greedy and sample(logits, [SampleRow(tiny, None, 0, [], [], False, 0)] * 4)[0] == best
    n = 4000
    flat = torch.tensor([[0.0, 50.0, 100.0, -100.0]])
    ids, _ = sample(flat.expand(n, -1), [row(SamplingParams(temperature=1e300), s) for s in range(n)])
    counts = torch.bincount(torch.tensor(ids), minlength=4)
    assert all(abs(c / n - 0.25) < 0.04 for c in counts.tolist())


def test_a_nan_logit_is_never_sampled() -> None:
    logits = torch.tensor([[math.nan, -50.0, -50.0, -60.0]])
    ids = {sample(logits, [row(SamplingParams(temperature=1.0), seed)])[0][0] for seed in range(20)}
    assert ids <= {1, 2, 3} and ids


def test_a_row_with_everything_blocked_takes_its_best_logit() -> None:
    logits = torch.tensor([[0.5, 3.0, 1.0], [2.0, 0.0, 0.0]])
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        ids, _ = sample(logits[:1], [row(params, 1, blocked=(0, 1, 2))])
        assert ids == [1]
        ids, _ = sample(logits, [row(params, 1, blocked=(0, 1, 2)), row(params, 1, blocked=(0,))])
        assert ids[0] == 1 and ids[1] in (1, 2)  # a live row beside it changes nothing
