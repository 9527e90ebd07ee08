"""Constraints, penalties and logit bias through gRPC: bad input is INVALID_ARGUMENT naming the field (and the
library's reason), constrained answers end FINISH_REASON_CONSTRAINT and validate, the prompt and a session's
earlier turns are never constrained, and grpcurl reaches every new field from reflection alone."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
from harness import ServerThread, bad_request_fields, smollm2_tokenizer
from test_grpcurl import GRPCURL, grpcurl, json_messages

from llmserve_client import build_request, pb

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}

BAD = [
    ("sampling.frequency_penalty", "[-2, 2]", build_request("hi", frequency_penalty=2.5)),
    ("sampling.presence_penalty", "[-2, 2]", build_request("hi", presence_penalty=-3.0)),
    ("sampling.logit_bias", "[-100, 100]", build_request("hi", logit_bias={5: 101.0})),
    ("sampling.logit_bias", "[0, 49152)", build_request("hi", logit_bias={49152: 1.0})),
    ("sampling.logit_bias", "--max-logit-bias", build_request("hi", logit_bias={i: 1.0 for i in range(301)})),
    ("constraint.json_schema", "not JSON", build_request("hi", json_schema="{oops")),
    ("constraint.json_schema", "uniqueItems", build_request("hi", json_schema={"type": "array", "uniqueItems": True})),
    ("constraint.json_schema", "--max-constraint-chars", build_request("hi", json_schema=" " * 65537)),
    ("constraint.json_schema", "must not be empty", build_request("hi", json_schema="")),
    ("constraint.regex", "unclosed", build_request("hi", regex="[0-9")),
    ("constraint.grammar", "nothing", build_request("hi", grammar="start: nothing")),
    ("constraint.choice.options", "must not be empty", pb.GenerateRequest(text="hi", constraint={"choice": {}})),
    ("constraint.choice.options", "empty string", build_request("hi", choice=["a", ""])),
]


@pytest.mark.parametrize(("field", "reason", "request_pb"), BAD, ids=[f"{f}-{i}" for i, (f, *_) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(
    server: ServerThread, stub, field: str, reason: str, request_pb: pb.GenerateRequest
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_pb, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(f"{field}: ") and reason in err.value.details(), err.value.details()
    assert bad_request_fields(err.value) == [field]
    assert server.engine.num_running == 0


def test_a_json_schema_answer_ends_by_the_constraint_and_validates(stub) -> None:
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)):
        request = build_request(
            "Weather:", json_schema=SCHEMA, max_new_tokens=96, temperature=temperature, seed=seed, return_token_ids=True
        )
        responses = list(stub.Generate(request, timeout=60))
        last = responses[-1]
        text = "".join(r.text for r in responses)
        if last.finish_reason == pb.FINISH_REASON_LENGTH:
            continue  # may be incomplete: documented
        assert last.finish_reason in (pb.FINISH_REASON_CONSTRAINT, pb.FINISH_REASON_EOS), last
        jsonschema.validate(json.loads(text), SCHEMA)
        assert last.usage.completion_tokens == sum(len(r.token_ids) for r in responses)


def test_regex_and_choice_answers_match(stub) -> None:
    for seed in range(4):
        responses = list(
            stub.Generate(
                build_request("Date:", regex=r"20[0-9]{2}-(0[1-9]|1[0-2])", temperature=1.0, seed=seed), timeout=60
            )
        )
        assert responses[-1].finish_reason == pb.FINISH_REASON_CONSTRAINT
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", "".join(r.text for r in responses))
        responses = list(
            stub.Generate(
                build_request("Pick:", choice=["red", "green", "blue"], temperature=1.0, seed=seed), timeout=60
            )
        )
        assert "".join(r.text for r in responses) in ("red", "green", "blue")


def test_the_prompt_and_earlier_turns_are_not_constrained(stub) -> None:
    """Neither the prompt (not digits) nor a continued session's history feeds the constraint: only the answer."""
    request = build_request("Not a number at all: ", regex="[0-9]{3}", session_id="c-1", max_new_tokens=8)
    first = "".join(r.text for r in stub.Generate(request, timeout=60))
    assert re.fullmatch("[0-9]{3}", first)
    follow = build_request(" and then", session_id="c-1", continue_session=True, choice=["yes", "no"])
    responses = list(stub.Generate(follow, timeout=60))
    assert "".join(r.text for r in responses) in ("yes", "no")
    assert responses[-1].usage.prompt_tokens > len(smollm2_tokenizer().encode("Not a number at all: "))


def test_logit_bias_and_presence_penalty_reach_the_sampler(stub) -> None:
    forced = smollm2_tokenizer().encode(" banana", add_special_tokens=False)[0]
    request = build_request(
        "Hello", logit_bias={forced: 100.0}, max_new_tokens=4, ignore_eos=True, return_token_ids=True
    )
    assert [t for r in stub.Generate(request, timeout=60) for t in r.token_ids] == [forced] * 4
    # A presence penalty of 2 on top of the +100 still leaves the forced token far ahead: it repeats...
    request.sampling.presence_penalty = 2.0
    assert [t for r in stub.Generate(request, timeout=60) for t in r.token_ids] == [forced] * 4
    # ... while banning it moves greedy decoding elsewhere.
    plain = build_request("Hello", max_new_tokens=4, ignore_eos=True, return_token_ids=True)
    ids = [t for r in stub.Generate(plain, timeout=60) for t in r.token_ids]
    plain.sampling.logit_bias[ids[0]] = -100.0
    banned = [t for r in stub.Generate(plain, timeout=60) for t in r.token_ids]
    assert ids[0] not in banned


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed")
def test_grpcurl_reaches_every_new_field(server: ServerThread) -> None:
    calls = {
        "json_schema": {"constraint": {"json_schema": json.dumps(SCHEMA)}},
        "json_object": {"constraint": {"json_object": True}},
        "regex": {"constraint": {"regex": "[a-c]{4}"}},
        "grammar": {"constraint": {"grammar": 'start: "x=" /[0-9]{2}/'}},
        "choice": {"constraint": {"choice": {"options": ["yes", "no"]}}},
        "penalties": {"sampling": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"5": -100}}},
    }
    for name, fields in calls.items():
        data = json.dumps({"text": "Answer:", "stopping": {"max_new_tokens": 64}, **fields})
        out = grpcurl(server, "llmserve.v1.GenerateService/Generate", data=data)
        assert out.returncode == 0, (name, out.stderr)
        messages = json_messages(out.stdout)
        assert messages[-1]["finish_reason"] in (
            "FINISH_REASON_CONSTRAINT",
            "FINISH_REASON_EOS",
            "FINISH_REASON_LENGTH",
        )
        if name in ("regex", "grammar", "choice"):
            assert messages[-1]["finish_reason"] == "FINISH_REASON_CONSTRAINT", (name, messages[-1])
