"""vLLM's engine protocol (`vllm.grpc.engine`, smg-grpc-proto) to llmserve's own request, and deltas back.

The vLLM GenerateRequest is translated into an `llmserve.v1.GenerateRequest`, so that the one set of rules both
edges share (the size limits of api/limits.py, the defaults of api/convert.py, the value checks of the engine's
request types) applies to it unchanged. What llmserve cannot do is refused here, naming the vLLM field. Errors
raised later name the llmserve field; `in_vllm_terms` renames it to the vLLM path the caller sent
(`stopping.max_new_tokens` -> `sampling_params.max_tokens`).

vLLM's conventions, as its own servicer reads them: an unset temperature is 1.0 (sampled), top_p and
repetition_penalty 0 mean unset (1.0), `logprobs` N asks for the chosen token's logprob and the top N,
`prompt_logprobs` N for each prompt token's logprob and the top N at its position: `InputLogProbs` with one entry per
prompt token, the first without a value, on the first chunk of a stream (or in the GenerateComplete of a call that does
not stream), as vLLM's servicer fills it. vLLM's Logprob also has each token's rank in the vocabulary; the proto
carries none, so none is computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.outputs import Delta, FinishReason, TokenLogprob
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb

# An unset temperature samples, as in vLLM and OpenAI.
DEFAULT_TEMPERATURE = 1.0
_SP = "sampling_params"
# llmserve's field path -> the vLLM request's (anything not listed keeps its name: request_id, request).
_VLLM_FIELDS = {
    "text": "text",
    "token_ids": "tokenized.input_ids",
    "token_ids.ids": "tokenized.input_ids",
    "input": "input",
    "stopping.max_new_tokens": f"{_SP}.max_tokens",
    "stopping.min_new_tokens": f"{_SP}.min_tokens",
    "stopping.stop_sequences": f"{_SP}.stop",
    "stopping.stop_token_ids": f"{_SP}.stop_token_ids",
    "response.top_logprobs": f"{_SP}.logprobs",
    "response.prompt_top_logprobs": f"{_SP}.prompt_logprobs",
    "n": f"{_SP}.n",
    "constraint.choice.options": f"{_SP}.choice.choices",
}
for _name in ("json_schema", "json_object", "regex", "grammar"):
    _VLLM_FIELDS[f"constraint.{_name}"] = f"{_SP}.{_name}"
# How an llmserve finish reads in vLLM's words.
_FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.CONSTRAINT: "stop",
    FinishReason.CANCELLED: "abort",
    FinishReason.DEADLINE: "abort",
    FinishReason.ERROR: "error",
}


def vllm_field(name: str) -> str:
    """The vLLM request's path for an llmserve field path."""
    if name in _VLLM_FIELDS:
        return _VLLM_FIELDS[name]
    if name.startswith("sampling."):
        return f"{_SP}.{name.removeprefix('sampling.')}"
    return name


def in_vllm_terms(exc: InvalidRequest) -> InvalidRequest:
    """The same refusal, naming the field by its vLLM path."""
    return InvalidRequest(vllm_field(exc.field), exc.reason)


def to_llmserve_request(request: vpb.GenerateRequest) -> pb.GenerateRequest:
    """The vLLM request as llmserve's GenerateRequest (values copied as sent: the shared checks come after)."""
    _refuse_unsupported(request)
    s = request.sampling_params
    out = pb.GenerateRequest(request_id=request.request_id, n=s.n)
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        out.token_ids.ids.extend(request.tokenized.input_ids)
    elif kind == "text":
        out.text = request.text
    else:
        raise InvalidRequest("input", "set one of tokenized, text")
    sampling = out.sampling
    sampling.temperature = s.temperature if s.HasField("temperature") else DEFAULT_TEMPERATURE
    if s.top_p != 0.0:
        sampling.top_p = s.top_p
    if s.repetition_penalty != 0.0:
        sampling.repetition_penalty = s.repetition_penalty
    sampling.top_k, sampling.min_p = s.top_k, s.min_p
    sampling.frequency_penalty, sampling.presence_penalty = s.frequency_penalty, s.presence_penalty
    if s.HasField("seed"):
        if s.seed < 0:
            raise InvalidRequest(f"{_SP}.seed", f"must be >= 0, got {s.seed}")
        sampling.seed = s.seed
    for token_id, bias in s.logit_bias.items():
        sampling.logit_bias[token_id] = bias
    stopping = out.stopping
    if s.HasField("max_tokens"):
        stopping.max_new_tokens = s.max_tokens
    stopping.min_new_tokens = s.min_tokens
    stopping.stop_sequences.extend(s.stop)
    stopping.stop_token_ids.extend(s.stop_token_ids)
    stopping.include_stop_sequence = s.include_stop_str_in_output
    stopping.ignore_eos = s.ignore_eos
    top, prompt_top = _alternatives(s, "logprobs"), _alternatives(s, "prompt_logprobs")
    if top is not None:
        out.response.logprobs, out.response.top_logprobs = True, top
    if prompt_top is not None:
        out.response.prompt_logprobs, out.response.prompt_top_logprobs = True, prompt_top
    _constraint(s, out.constraint)
    return out


def _alternatives(s: vpb.SamplingParams, name: str) -> int | None:
    """How many alternatives `logprobs` or `prompt_logprobs` (`name`) asks for; None where unset. A negative count
    (vLLM's -1: the whole vocabulary) is refused naming the field."""
    if not s.HasField(name):
        return None
    count: int = getattr(s, name)
    if count < 0:
        raise InvalidRequest(f"{_SP}.{name}", f"must be >= 0 (-1, the whole vocabulary, is not served), got {count}")
    return count


def _refuse_unsupported(request: vpb.GenerateRequest) -> None:
    """What the vLLM protocol can ask that llmserve does not do, refused by name rather than ignored."""
    s = request.sampling_params
    refusals = (
        (s.HasField("truncate_prompt_tokens"), f"{_SP}.truncate_prompt_tokens", "prompts are not truncated"),
        (
            s.WhichOneof("constraint") == "structural_tag",
            f"{_SP}.structural_tag",
            "structural tags (tool-call formats triggered inside free text) are not served; use json_schema, "
            "regex, grammar, choice or json_object",
        ),
        (request.HasField("mm_inputs") or len(request.extra_mm_inputs) > 0, "mm_inputs", "the model is text-only"),
        (request.HasField("media_refs"), "media_refs", "the model is text-only"),
        (
            request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"),
            "kv_transfer_params",
            "prefill/decode disaggregation is not served",
        ),
        (
            request.HasField("data_parallel_rank") and request.data_parallel_rank != 0,
            "data_parallel_rank",
            "this server has one rank, 0",
        ),
    )
    for refused, name, reason in refusals:
        if refused:
            raise InvalidRequest(name, reason)


def _constraint(s: vpb.SamplingParams, out: pb.Constraint) -> None:
    kind = s.WhichOneof("constraint")
    if kind == "choice":
        out.choice.options.extend(s.choice.choices)
    elif kind == "json_object":
        out.json_object = s.json_object
    elif kind in ("json_schema", "regex", "grammar"):
        setattr(out, kind, getattr(s, kind))


@dataclass(slots=True)
class Completion:
    """One completion's output so far, for a call that does not stream (sent whole in its GenerateComplete)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, delta: Delta) -> None:
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or ()
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass(slots=True, frozen=True)
class LogprobCounts:
    """How many alternatives a call asked for: per generated token (`logprobs`), per prompt token (`prompt_logprobs`);
    and the prompt's token ids, which InputLogProbs lists."""

    top: int = 0
    prompt_top: int = 0
    prompt_ids: Sequence[int] = ()


def chunk(delta: Delta, prompt_tokens: int, counts: LogprobCounts) -> vpb.GenerateResponse:
    """A streamed chunk: only the completion's new token ids (and their logprobs; on the first, the prompt's)."""
    message = vpb.GenerateStreamChunk(
        token_ids=delta.token_ids,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(delta.token_ids),
        index=delta.index,
    )
    if delta.logprobs:
        message.output_logprobs.CopyFrom(output_logprobs(delta.logprobs, counts.top))
    if delta.prompt_logprobs is not None:
        message.input_logprobs.CopyFrom(input_logprobs(counts.prompt_ids, delta.prompt_logprobs, counts.prompt_top))
    return vpb.GenerateResponse(chunk=message)


def complete(delta: Delta, counts: LogprobCounts, whole: Completion | None = None) -> vpb.GenerateResponse:
    """A completion's end: finish reason, what matched, usage; with `whole` (not streamed) all its tokens (and the
    prompt's logprobs, when asked)."""
    assert delta.finish_reason is not None
    message = vpb.GenerateComplete(finish_reason=_FINISH[delta.finish_reason], index=delta.index)
    if delta.usage is not None:
        message.prompt_tokens = delta.usage.prompt_tokens
        message.cached_tokens = delta.usage.cached_prompt_tokens
        message.completion_tokens = delta.usage.completion_tokens
    if whole is not None:
        message.output_ids.extend(whole.token_ids)
        if whole.logprobs:
            message.output_logprobs.CopyFrom(output_logprobs(whole.logprobs, counts.top))
        if whole.prompt_logprobs is not None:
            message.input_logprobs.CopyFrom(input_logprobs(counts.prompt_ids, whole.prompt_logprobs, counts.prompt_top))
    if delta.finish_reason is FinishReason.STOP_SEQUENCE and delta.matched_stop is not None:
        message.matched_stop_str = delta.matched_stop
    elif delta.finish_reason is FinishReason.STOP_TOKEN and delta.token_ids:
        message.matched_token_id = delta.token_ids[-1]
    return vpb.GenerateResponse(complete=message)


def output_logprobs(logprobs: Sequence[TokenLogprob], top_logprobs: int) -> vpb.OutputLogProbs:
    out = vpb.OutputLogProbs()
    for lp in logprobs:
        out.token_ids.append(lp.token_id)
        out.token_logprobs.append(lp.logprob)
        if top_logprobs:
            out.top_logprobs.append(vpb.TopLogProbs(token_ids=[t for t, _ in lp.top], values=[p for _, p in lp.top]))
    return out


def input_logprobs(prompt_ids: Sequence[int], scores: Sequence[TokenLogprob], top_logprobs: int) -> vpb.InputLogProbs:
    """vLLM's InputLogProbs: one entry per prompt token, the first without a value (nothing precedes it), each
    later one its token's logprob; with `top_logprobs`, the alternatives at each position (none at the first)."""
    out = vpb.InputLogProbs()
    if not prompt_ids:
        return out
    out.token_ids.append(prompt_ids[0])
    out.token_logprobs.append(vpb.InputTokenLogProb())
    if top_logprobs:
        out.top_logprobs.append(vpb.TopLogProbs())
    for lp in scores:
        out.token_ids.append(lp.token_id)
        out.token_logprobs.append(vpb.InputTokenLogProb(value=lp.logprob))
        if top_logprobs:
            out.top_logprobs.append(vpb.TopLogProbs(token_ids=[t for t, _ in lp.top], values=[p for _, p in lp.top]))
    return out
