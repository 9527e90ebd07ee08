"""api/vllm_convert.py on its own: a vLLM GenerateRequest becomes llmserve's own request with vLLM's conventions
(an unset temperature samples, 0 means unset for top_p and repetition_penalty, `logprobs` N is the chosen token's
logprob and the top N), what llmserve does not serve is refused naming the vLLM field, errors raised later are renamed
to the vLLM path, and deltas become vLLM's chunks and completes. Through a server: tests/service/test_vllm_servicer.py.
"""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from llmserve.api.vllm_convert import (
    DEFAULT_TEMPERATURE,
    Completion,
    LogprobCounts,
    chunk,
    complete,
    in_vllm_terms,
    to_llmserve_request,
    vllm_field,
)
from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.outputs import Delta, FinishReason, TokenLogprob, Usage


def request(**sampling: object) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="r",
        tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vpb.SamplingParams(**sampling),
    )


def test_unset_values_take_vllms_conventions() -> None:
    out = to_llmserve_request(request())
    assert out.request_id == "r" and list(out.token_ids.ids) == [5, 6, 7]
    assert out.sampling.temperature == DEFAULT_TEMPERATURE == 1.0  # unset: sampled, as in vLLM and OpenAI
    assert not out.sampling.HasField("top_p") and not out.sampling.HasField("repetition_penalty")  # 0: unset
    assert not out.sampling.HasField("seed") and not out.stopping.HasField("max_new_tokens")
    assert not out.response.logprobs and out.response.top_logprobs == 0
    assert out.WhichOneof("input") == "token_ids" and out.constraint.WhichOneof("kind") is None
    assert to_llmserve_request(request(temperature=0.0)).sampling.temperature == 0.0  # greedy when sent as 0


def test_every_value_sent_is_copied() -> None:
    sent = request(
        temperature=0.5, top_p=0.9, top_k=7, min_p=0.05, frequency_penalty=0.25, presence_penalty=-0.5,
        repetition_penalty=1.2, max_tokens=12, min_tokens=3, stop=["END"], stop_token_ids=[2, 9],
        include_stop_str_in_output=True, ignore_eos=True, seed=0, n=3, logprobs=4, logit_bias={11: -100.0},
    )  # fmt: skip
    out = to_llmserve_request(sent)
    s, st = out.sampling, out.stopping
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == pytest.approx((0.5, 0.9, 7, 0.05))
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == pytest.approx((0.25, -0.5, 1.2))
    assert s.HasField("seed") and s.seed == 0 and dict(s.logit_bias) == {11: -100.0}
    assert (st.max_new_tokens, st.min_new_tokens, list(st.stop_sequences), list(st.stop_token_ids)) == (
        12, 3, ["END"], [2, 9],
    )  # fmt: skip
    assert st.include_stop_sequence and st.ignore_eos and out.n == 3
    assert out.response.logprobs and out.response.top_logprobs == 4
    # logprobs 0: the chosen token's logprob, no alternatives.
    zero = to_llmserve_request(request(logprobs=0)).response
    assert zero.logprobs and zero.top_logprobs == 0
    text = to_llmserve_request(vpb.GenerateRequest(request_id="t", text="hello"))
    assert text.WhichOneof("input") == "text" and text.text == "hello"


@pytest.mark.parametrize(
    ("constraint", "kind", "value"),
    [
        ({"json_schema": '{"type": "object"}'}, "json_schema", '{"type": "object"}'),
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"grammar": 'start: "x"'}, "grammar", 'start: "x"'),
        ({"json_object": True}, "json_object", True),
    ],
)
def test_constraints_carry_over(constraint: dict[str, object], kind: str, value: object) -> None:
    out = to_llmserve_request(request(**constraint)).constraint
    assert out.WhichOneof("kind") == kind and getattr(out, kind) == value


def test_a_choice_carries_its_options() -> None:
    out = to_llmserve_request(request(choice=vpb.ChoiceConstraint(choices=["yes", "no"]))).constraint
    assert list(out.choice.options) == ["yes", "no"]


@pytest.mark.parametrize(
    ("sent", "field"),
    [
        (vpb.GenerateRequest(request_id="r"), "input"),
        (request(seed=-1), "sampling_params.seed"),
        (request(logprobs=-1), "sampling_params.logprobs"),
        (request(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
        (request(truncate_prompt_tokens=8), "sampling_params.truncate_prompt_tokens"),
        (request(structural_tag='{"type": "structural_tag"}'), "sampling_params.structural_tag"),
        (vpb.GenerateRequest(request_id="r", text="x", media_refs=vpb.MediaRefs()), "media_refs"),
        (vpb.GenerateRequest(request_id="r", text="x", mm_inputs=vpb.MultimodalInputs()), "mm_inputs"),
        (vpb.GenerateRequest(request_id="r", text="x", extra_mm_inputs=[vpb.MultimodalInputs()]), "mm_inputs"),
        (
            vpb.GenerateRequest(request_id="r", text="x", kv_transfer_params=vpb.KvTransferParams()),
            "kv_transfer_params",
        ),
        (vpb.GenerateRequest(request_id="r", text="x", kv_transfer_params_json="{}"), "kv_transfer_params"),
        (vpb.GenerateRequest(request_id="r", text="x", data_parallel_rank=1), "data_parallel_rank"),
    ],
)
def test_what_is_not_served_is_refused_naming_the_vllm_field(sent: vpb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        to_llmserve_request(sent)
    assert err.value.field == field and err.value.reason


def test_rank_zero_is_this_server() -> None:
    assert to_llmserve_request(vpb.GenerateRequest(request_id="r", text="x", data_parallel_rank=0)).text == "x"


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("token_ids.ids", "tokenized.input_ids"),
        ("stopping.max_new_tokens", "sampling_params.max_tokens"),
        ("stopping.stop_sequences", "sampling_params.stop"),
        ("response.top_logprobs", "sampling_params.logprobs"),
        ("response.prompt_top_logprobs", "sampling_params.prompt_logprobs"),
        ("n", "sampling_params.n"),
        ("constraint.json_schema", "sampling_params.json_schema"),
        ("constraint.choice.options", "sampling_params.choice.choices"),
        ("sampling.top_p", "sampling_params.top_p"),  # every sampling field keeps its name
        ("request_id", "request_id"),  # anything else keeps its path
    ],
)
def test_errors_raised_later_name_the_vllm_path(ours: str, theirs: str) -> None:
    assert vllm_field(ours) == theirs
    renamed = in_vllm_terms(InvalidRequest(ours, "is wrong"))
    assert (renamed.field, renamed.reason) == (theirs, "is wrong")


def test_a_chunk_carries_only_the_new_ids_and_their_logprobs() -> None:
    logprobs = [TokenLogprob(4, -0.5, [(4, -0.5), (8, -1.5)]), TokenLogprob(6, -0.25, [(6, -0.25), (1, -2.0)])]
    delta = Delta("r", [4, 6], text="ignored", logprobs=logprobs, index=2)
    message = chunk(delta, prompt_tokens=9, counts=LogprobCounts(2))
    c = message.chunk
    assert (list(c.token_ids), c.prompt_tokens, c.completion_tokens, c.index) == ([4, 6], 9, 2, 2)
    lp = c.output_logprobs
    assert list(lp.token_ids) == [4, 6] and list(lp.token_logprobs) == [-0.5, -0.25]
    assert [list(t.token_ids) for t in lp.top_logprobs] == [[4, 8], [6, 1]]
    assert [list(t.values) for t in lp.top_logprobs] == [[-0.5, -1.5], [-0.25, -2.0]]
    plain = chunk(Delta("r", [3]), prompt_tokens=9, counts=LogprobCounts(0)).chunk
    assert not plain.HasField("output_logprobs")
    no_top = chunk(Delta("r", [4], logprobs=logprobs[:1]), prompt_tokens=9, counts=LogprobCounts(0)).chunk
    assert list(no_top.output_logprobs.token_ids) == [4] and len(no_top.output_logprobs.top_logprobs) == 0


@pytest.mark.parametrize(
    ("reason", "vllm"),
    [
        (FinishReason.LENGTH, "length"),
        (FinishReason.EOS, "stop"),
        (FinishReason.STOP_SEQUENCE, "stop"),
        (FinishReason.STOP_TOKEN, "stop"),
        (FinishReason.CONSTRAINT, "stop"),
        (FinishReason.CANCELLED, "abort"),
        (FinishReason.DEADLINE, "abort"),
        (FinishReason.ERROR, "error"),
    ],
)
def test_every_finish_reads_in_vllms_words(reason: FinishReason, vllm: str) -> None:
    assert complete(Delta("r", [], finish_reason=reason), counts=LogprobCounts(0)).complete.finish_reason == vllm


def test_a_complete_carries_usage_what_matched_and_for_a_whole_call_every_token() -> None:
    usage = Usage(prompt_tokens=9, cached_prompt_tokens=4, completion_tokens=3)
    stop = Delta("r", [7], finish_reason=FinishReason.STOP_SEQUENCE, usage=usage, matched_stop="END", index=1)
    c = complete(stop, counts=LogprobCounts(0)).complete
    assert (c.prompt_tokens, c.cached_tokens, c.completion_tokens, c.index) == (9, 4, 3, 1)
    assert c.WhichOneof("matched_stop") == "matched_stop_str" and c.matched_stop_str == "END"
    assert list(c.output_ids) == []  # streamed: the ids went in the chunks
    token = complete(Delta("r", [5, 2], finish_reason=FinishReason.STOP_TOKEN), counts=LogprobCounts(0)).complete
    assert token.WhichOneof("matched_stop") == "matched_token_id" and token.matched_token_id == 2
    eos = complete(Delta("r", [2], finish_reason=FinishReason.EOS), counts=LogprobCounts(0)).complete
    assert eos.WhichOneof("matched_stop") is None
    whole = Completion()
    whole.add(Delta("r", [4], logprobs=[TokenLogprob(4, -0.5, [(4, -0.5)])]))
    whole.add(Delta("r", [6], logprobs=[TokenLogprob(6, -0.25, [(6, -0.25)])]))
    last = complete(Delta("r", [], finish_reason=FinishReason.LENGTH), counts=LogprobCounts(1), whole=whole).complete
    assert list(last.output_ids) == [4, 6] and list(last.output_logprobs.token_logprobs) == [-0.5, -0.25]
    assert [list(t.token_ids) for t in last.output_logprobs.top_logprobs] == [[4], [6]]


def test_prompt_logprobs_n_asks_for_each_prompt_tokens_logprob_and_the_top_n() -> None:
    assert not to_llmserve_request(request()).response.prompt_logprobs
    for n in (0, 3):
        response = to_llmserve_request(request(prompt_logprobs=n)).response
        assert (response.prompt_logprobs, response.prompt_top_logprobs) == (True, n)


def test_input_logprobs_list_every_prompt_token_the_first_without_a_value() -> None:
    scores = [TokenLogprob(8, -1.5, [(3, -0.5), (8, -1.5)]), TokenLogprob(9, -0.25, [(9, -0.25), (1, -2.0)])]
    counts = LogprobCounts(top=0, prompt_top=2, prompt_ids=[7, 8, 9])
    first = chunk(Delta("r", [4], prompt_logprobs=scores), prompt_tokens=3, counts=counts).chunk
    inputs = first.input_logprobs
    assert list(inputs.token_ids) == [7, 8, 9]
    assert [lp.HasField("value") for lp in inputs.token_logprobs] == [False, True, True]
    assert [lp.value for lp in inputs.token_logprobs[1:]] == [-1.5, -0.25]
    assert [list(t.token_ids) for t in inputs.top_logprobs] == [[], [3, 8], [9, 1]]
    assert [list(t.values) for t in inputs.top_logprobs] == [[], [-0.5, -1.5], [-0.25, -2.0]]
    later = chunk(Delta("r", [5]), prompt_tokens=3, counts=counts).chunk
    assert not later.HasField("input_logprobs")  # the first chunk only
    # Not streamed: in the completion's GenerateComplete; without top-n, no alternatives.
    whole = Completion()
    whole.add(Delta("r", [4], prompt_logprobs=scores))
    whole.add(Delta("r", [5]))
    done = Delta("r", [], finish_reason=FinishReason.LENGTH)
    inputs = complete(done, LogprobCounts(prompt_ids=[7, 8, 9]), whole).complete.input_logprobs
    assert list(inputs.token_ids) == [7, 8, 9] and len(inputs.top_logprobs) == 0
