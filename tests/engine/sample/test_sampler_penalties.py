"""The sampler's OpenAI-style logit edits: frequency and presence penalties over generated tokens, logit bias."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.engine.sample import sampler
from llmserve.engine.sample.sampler import _apply_additive, _apply_repetition_penalty
from llmserve.engine.sample.streams import RandomStreams
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.outputs import TokenLogprob
from llmserve.engine.types.request import SamplingParams

_keys = itertools.count()  # each row its own sequence, hence its own stream


def _row(params: SamplingParams, token_ids: list[int], num_prompt: int = 0, seed: int = 0) -> SampleRow:
    seed_or_none = None if params.greedy else seed
    return SampleRow(params, seed_or_none, next(_keys), token_ids, (), False, 0, num_prompt=num_prompt)


def sample(
    logits: torch.Tensor, rows: list[SampleRow], streams: RandomStreams | None = None
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The sampler with fresh streams, unless `streams` is given (a row's draws go on from call to call)."""
    return sampler.sample(logits, rows, RandomStreams() if streams is None else streams)


def _reference(logits: list[float], params: SamplingParams, token_ids: list[int], num_prompt: int) -> torch.Tensor:
    """OpenAI's formula written out token by token, in float32 as the sampler computes it."""
    out = torch.tensor(logits, dtype=torch.float32)
    generated = token_ids[num_prompt:]
    for token in set(generated):
        count = torch.tensor(float(generated.count(token)), dtype=torch.float32)
        amount = count * torch.tensor(params.frequency_penalty, dtype=torch.float32) + torch.tensor(
            params.presence_penalty, dtype=torch.float32
        )
        out[token] = out[token] - amount
    for token, bias in params.logit_bias:
        out[token] = out[token] + torch.tensor(bias, dtype=torch.float32)
    return out


@settings(max_examples=80, deadline=None)
@given(
    vocab=st.sampled_from([5, 50, 700]),
    specs=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, -1.25, 2.0]),
            st.sampled_from([0.0, 0.3, -2.0, 1.0]),
            st.integers(0, 4),  # how many logit biases
            st.lists(st.integers(0, 10**6), max_size=12),  # token ids (mod vocab), prompt then generated
            st.integers(0, 12),  # prompt length
        ),
        min_size=1,
        max_size=6,
    ),
    data_seed=st.integers(0, 1000),
)
def test_the_edits_equal_openais_formula_row_by_row(vocab, specs, data_seed) -> None:
    gen = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(specs), vocab, generator=gen) * 3
    rows, references = [], []
    for i, (frequency, presence, n_bias, ids, n_prompt) in enumerate(specs):
        ids = [t % vocab for t in ids]
        bias_ids = sorted({(i * 7 + j * 13) % vocab for j in range(n_bias)})
        bias = tuple((t, [-100.0, 3.5, 0.25, 100.0][k % 4]) for k, t in enumerate(bias_ids))
        params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence, logit_bias=bias)
        n_prompt = min(n_prompt, len(ids))
        rows.append(_row(params, ids, n_prompt))
        references.append(_reference(logits[i].tolist(), params, ids, n_prompt))
    ours = logits.clone()
    _apply_additive(ours, rows)
    assert torch.equal(ours, torch.stack(references))


def test_prompt_tokens_are_not_penalised() -> None:
    logits = torch.zeros(1, 10)
    x = logits.clone()
    _apply_additive(x, [_row(SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), [3, 3, 4, 5, 5], 3)])
    # Prompt: 3, 3, 4. Generated: 5, 5 -> 2 * 1 + 1.
    assert x[0].tolist() == [0.0] * 5 + [-3.0] + [0.0] * 4


def test_greedy_follows_the_edits() -> None:
    logits = torch.tensor([[5.0, 4.9, 1.0, 0.0], [5.0, 4.9, 1.0, 0.0], [5.0, 4.9, 1.0, 0.0], [5.0, 4.9, 1.0, 0.0]])
    rows = [
        _row(SamplingParams(), [0]),  # no edit: the favourite
        _row(SamplingParams(presence_penalty=0.2), [0]),  # the favourite was generated: the runner-up wins
        _row(SamplingParams(presence_penalty=0.2), [0], num_prompt=1),  # ... but only when generated
        _row(SamplingParams(logit_bias=((3, 100.0), (0, -100.0))), []),  # forced
    ]
    ids, _ = sample(logits, rows)
    assert ids == [0, 1, 0, 3]


def test_sampled_rows_never_pick_a_token_biased_out() -> None:
    logits = torch.zeros(64, 4)
    params = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0)))
    ids, _ = sample(logits, [_row(params, [], seed=s) for s in range(64)])
    assert set(ids) <= {2, 3} and set(ids) == {2, 3}


def test_additive_edits_come_after_the_repetition_penalty() -> None:
    logits = torch.tensor([[2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    rows = [_row(params, [0])]
    x = logits.clone()
    _apply_repetition_penalty(x, rows)
    _apply_additive(x, rows)
    assert x.tolist() == [[0.0, 1.0]]  # 2 / 2 - 1, not (2 - 1) / 2
    assert sample(logits, rows)[0] == [1]


def test_a_row_alone_or_in_a_batch_gets_the_same_tokens() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 6, 300, generator=gen) * 2
    target = SamplingParams(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.4, logit_bias=((7, 2.0),))
    history = [1, 2, 2, 7, 9, 9, 9]
    lone = _row(target, history, 2, seed=11)
    streams = RandomStreams()
    alone = [sample(logits[s, 2:3], [lone], streams)[0][0] for s in range(5)]
    others = [SamplingParams(presence_penalty=1.0), SamplingParams(temperature=1.0, logit_bias=((1, -5.0),))]
    batch_rows = [_row(others[0], [4, 4]), _row(others[1], [1], seed=1), _row(target, history, 2, seed=11)]
    batch_rows += [_row(SamplingParams(), [3]), _row(others[0], []), _row(SamplingParams(temperature=0.5), [0], seed=2)]
    streams = RandomStreams()
    batched = [sample(logits[s], batch_rows, streams)[0][2] for s in range(5)]
    assert batched == alone


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(frequency_penalty=2.5), "sampling.frequency_penalty"),
        (SamplingParams(presence_penalty=-2.01), "sampling.presence_penalty"),
        (SamplingParams(presence_penalty=float("nan")), "sampling.presence_penalty"),
        (SamplingParams(logit_bias=((1, 100.5),)), "sampling.logit_bias"),
        (SamplingParams(logit_bias=((1, float("inf")),)), "sampling.logit_bias"),
        (SamplingParams(logit_bias=((1, 1.0), (1, 2.0))), "sampling.logit_bias"),
    ],
)
def test_out_of_range_values_name_their_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        params.validate()
    assert err.value.field == field
