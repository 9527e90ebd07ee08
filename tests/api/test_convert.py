"""api/convert.py on its own: llmserve.v1's GenerateRequest to the engine's GenerationRequest (the server's defaults
filled in, values copied as sent: the engine's request types check them), and each Delta to one GenerateResponse.
The sampling and stopping defaults, the deadline and the cache salt the servicer adds: tests/api/test_servicer.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.api.convert import (
    constraint_spec,
    input_text,
    logprob_pb,
    softmax,
    to_embedding,
    to_generation_request,
    to_response,
)
from llmserve.engine.types.outputs import Delta, FinishReason, Timing, TokenLogprob, Usage
from llmserve.engine.types.protocol import ModelInfo
from llmserve.engine.types.request import ConstraintKind, ConstraintSpec
from llmserve.telemetry.request_log import MAX_LOGGED_PROMPT_CHARS
from llmserve_client import build_request, pb

INFO = ModelInfo("m", context_length=1000, max_new_tokens=300, dtype="float32", device="cpu", vocab_size=256)


def convert(request: pb.GenerateRequest, prompt_len: int = 10, **kwargs: object):  # noqa: ANN201 - the engine's type
    return to_generation_request(
        request, [1] * prompt_len, request_id="r", info=INFO, default_max_new_tokens=200, **kwargs
    )


def test_logprobs_and_the_logged_input_convert_exactly() -> None:
    """Every logprob value reaches the message; the log's input summary."""
    message = logprob_pb(TokenLogprob(7, -0.25, [(7, -0.25), (3, -1.5)]))
    assert (message.token_id, message.logprob) == (7, -0.25)
    assert [(t.token_id, t.logprob) for t in message.top_logprobs] == [(7, -0.25), (3, -1.5)]
    assert input_text(pb.GenerateRequest(text="hello")) == "hello"
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role="bot", content="yo")])
    assert input_text(pb.GenerateRequest(chat=chat)) == "user: hi | bot: yo"
    assert input_text(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))) == "<3 token ids>"


def test_the_logged_input_is_clipped() -> None:
    assert input_text(pb.GenerateRequest(text="x" * 100_000)) == "x" * MAX_LOGGED_PROMPT_CHARS + "..."
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="y" * 100_000)])
    assert input_text(pb.GenerateRequest(chat=chat)) == ("user: " + "y" * 100_000)[:MAX_LOGGED_PROMPT_CHARS] + "..."


@pytest.mark.parametrize(
    ("request_pb", "field"),
    [
        (build_request("hi"), "text"),
        (build_request(messages=[{"role": "user", "content": "hi"}]), "chat"),
        (build_request(token_ids=[5, 6]), "token_ids.ids"),
        (pb.GenerateRequest(), "input"),
    ],
)
def test_the_prompt_is_named_by_the_field_it_came_from(request_pb: pb.GenerateRequest, field: str) -> None:
    assert convert(request_pb).prompt_field == field


def test_the_request_keeps_what_the_call_carries() -> None:
    sent = build_request("hi", n=3, adapter="sql")
    sent.sampling.logit_bias[7] = -2.5
    sent.sampling.frequency_penalty, sent.sampling.presence_penalty = 0.5, -0.25
    sent.stopping.stop_sequences.append("\n")
    converted = convert(sent, session_key="s1", deadline=12.0, cache_salt="alice")
    assert (converted.request_id, converted.prompt_token_ids, converted.n, converted.adapter) == (
        "r",
        (1,) * 10,
        3,
        "sql",
    )
    assert (converted.session_id, converted.deadline, converted.cache_salt) == ("s1", 12.0, "alice")
    assert converted.sampling.logit_bias == ((7, -2.5),)
    assert (converted.sampling.frequency_penalty, converted.sampling.presence_penalty) == (0.5, -0.25)
    assert converted.stopping.stop_sequences == ("\n",)
    plain = convert(build_request("hi"))
    assert (plain.n, plain.adapter, plain.session_id, plain.constraint) == (1, None, None, None)  # n 0: one
    assert (plain.prompt_logprobs, plain.prompt_top_logprobs) == (False, 0)


@pytest.mark.parametrize(("asked", "top"), [(dict(prompt_logprobs=True), 0), (dict(prompt_top_logprobs=4), 4)])
def test_prompt_logprobs_are_asked_by_either_field(asked: dict[str, object], top: int) -> None:
    converted = convert(build_request("hi", **asked))  # type: ignore[arg-type]
    assert (converted.prompt_logprobs, converted.prompt_top_logprobs) == (True, top)


@pytest.mark.parametrize(
    ("constraint", "spec"),
    [
        (pb.Constraint(), None),
        (pb.Constraint(json_object=False), None),
        (pb.Constraint(json_object=True), ConstraintSpec(ConstraintKind.JSON_OBJECT, "")),
        (
            pb.Constraint(json_schema='{"type": "object"}'),
            ConstraintSpec(ConstraintKind.JSON_SCHEMA, '{"type": "object"}'),
        ),
        (pb.Constraint(regex="[0-9]+"), ConstraintSpec(ConstraintKind.REGEX, "[0-9]+")),
        (pb.Constraint(grammar='start: "a"'), ConstraintSpec(ConstraintKind.GRAMMAR, 'start: "a"')),
        (
            pb.Constraint(choice=pb.Choice(options=["yes", "no"])),
            ConstraintSpec(ConstraintKind.CHOICE, choices=("yes", "no")),
        ),
    ],
)
def test_each_constraint_reaches_the_engine_as_its_kind(constraint: pb.Constraint, spec: ConstraintSpec | None) -> None:
    assert constraint_spec(constraint) == spec
    assert convert(pb.GenerateRequest(text="hi", constraint=constraint)).constraint == spec


def test_a_delta_becomes_one_message_with_what_was_asked() -> None:
    options = pb.ResponseOptions(token_ids=True)
    delta = Delta("r", [4, 5], text="ab", logprobs=[TokenLogprob(4, -0.5), TokenLogprob(5, -1.0)], index=2)
    message = to_response("r", delta, options, [9, 9])
    assert (message.request_id, message.text, list(message.token_ids), message.index) == ("r", "ab", [4, 5], 2)
    assert list(message.prompt_token_ids) == [9, 9] and [lp.token_id for lp in message.logprobs] == [4, 5]
    assert message.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert not message.HasField("usage") and not message.HasField("timing") and not message.HasField("seed")
    assert list(to_response("r", delta, pb.ResponseOptions(), []).token_ids) == []  # ids only when asked
    assert not message.prompt_logprobs
    scores = [TokenLogprob(9, -2.0, [(3, -0.5), (9, -2.0)])]
    first = to_response("r", Delta("r", [4], prompt_logprobs=scores), pb.ResponseOptions(), [8, 9])
    assert [(lp.token_id, lp.logprob) for lp in first.prompt_logprobs] == [(9, -2.0)]
    assert [(t.token_id, t.logprob) for t in first.prompt_logprobs[0].top_logprobs] == [(3, -0.5), (9, -2.0)]


@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_finish_reason_has_its_enum_value(reason: FinishReason) -> None:
    message = to_response("r", Delta("r", [], finish_reason=reason), pb.ResponseOptions(), [])
    assert pb.FinishReason.Name(message.finish_reason) == f"FINISH_REASON_{reason.name}"


def test_the_last_message_carries_usage_timing_seed_and_the_whole_requests_usage() -> None:
    delta = Delta(
        "r", [], finish_reason=FinishReason.LENGTH, usage=Usage(10, 4, 3), timing=Timing(0.5, 0.75, 2.0), seed=11,
        total_usage=Usage(10, 4, 9),
    )  # fmt: skip
    message = to_response("r", delta, pb.ResponseOptions(), [])
    u, t = message.usage, message.total_usage
    assert (u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens) == (10, 4, 3)
    assert (t.prompt_tokens, t.cached_prompt_tokens, t.completion_tokens) == (10, 4, 9)
    timing = message.timing
    assert (timing.queue_seconds, timing.time_to_first_token_seconds, timing.total_seconds) == (0.5, 0.75, 2.0)
    assert message.HasField("seed") and message.seed == 11
    zero = to_response("r", Delta("r", [], usage=Usage(0, 0, 0), seed=0), pb.ResponseOptions(), [])
    assert zero.HasField("usage") and zero.HasField("seed")  # present although every value is 0


# No deadline: the first example pays torch's first call of each op (0.9 s on a loaded CI machine, 0.4 ms after).
@settings(deadline=None)
@given(st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=16))
def test_softmax_is_torchs_and_never_overflows(logits: list[float]) -> None:
    got = torch.tensor(softmax(logits), dtype=torch.float64)
    torch.testing.assert_close(got, torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0))


def test_a_classifiers_embedding_carries_the_softmax_of_its_logits() -> None:
    delta = Delta("r", [], finish_reason=FinishReason.LENGTH, usage=Usage(4, 0, 0), embedding=[0.0, 0.0])
    assert list(to_embedding(0, delta, False, classify=True).probabilities) == [0.5, 0.5]
    assert list(to_embedding(0, delta, False).probabilities) == []


@settings(deadline=None)  # as above: torch's first sigmoid
@given(st.floats(-1e4, 1e4))
def test_a_one_label_classifiers_probability_is_the_sigmoid_of_its_logit(logit: float) -> None:
    """Not a softmax over one value (always 1.0): the sigmoid, as sentence-transformers' CrossEncoder and TEI."""
    delta = Delta("r", [], finish_reason=FinishReason.LENGTH, usage=Usage(4, 0, 0), embedding=[logit])
    (got,) = to_embedding(0, delta, False, classify=True).probabilities
    assert got == pytest.approx(torch.sigmoid(torch.tensor(logit, dtype=torch.float64)).item(), rel=1e-6, abs=1e-30)
