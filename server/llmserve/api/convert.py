"""Protobuf to engine types and back: GenerateRequest -> GenerationRequest, Delta -> GenerateResponse.

Conversion fills in the server's defaults and copies values as sent; it checks nothing. Values are checked
once, by the engine's request types (`GenerationRequest.validate`), whose errors name the GenerateRequest
field by its protobuf path (`sampling.top_p`, and the input the prompt came from as `prompt_field`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmserve.engine.types.outputs import Delta, TokenLogprob
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import (
    ConstraintKind,
    ConstraintSpec,
    GenerationRequest,
    PoolingParams,
    SamplingParams,
    StoppingParams,
)
from llmserve.telemetry.request_log import MAX_LOGGED_PROMPT_CHARS, clip
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from llmserve.engine.types.protocol import ModelInfo

# The field an error about the prompt names, per input kind.
_PROMPT_FIELDS = {"text": "text", "chat": "chat", "token_ids": "token_ids.ids"}


def to_generation_request(
    request: pb.GenerateRequest,
    prompt_ids: Sequence[int],
    *,
    request_id: str,
    info: ModelInfo,
    default_max_new_tokens: int,
    session_key: str | None = None,
    deadline: float | None = None,
    cache_salt: str | None = None,
) -> GenerationRequest:
    """The engine's request for `request`, whose prompt (input, or history and input) is `prompt_ids`.

    An unset max_new_tokens is the least of the server's default, the model's limit and the room left in the
    context, and at least 1 (so that a prompt that fills the context is reported as such by the engine).
    """
    s, st = request.sampling, request.stopping
    sampling = SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        logit_bias=tuple(sorted(s.logit_bias.items())),
    )
    if st.HasField("max_new_tokens"):
        max_new_tokens = st.max_new_tokens
    else:
        room = info.context_length - len(prompt_ids)
        max_new_tokens = max(1, min(default_max_new_tokens, info.max_new_tokens, room))
    stopping = StoppingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=st.min_new_tokens,
        stop_sequences=tuple(st.stop_sequences),
        stop_token_ids=tuple(st.stop_token_ids),
        include_stop_sequence=st.include_stop_sequence,
        ignore_eos=st.ignore_eos,
    )
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt_ids),
        sampling=sampling,
        stopping=stopping,
        session_id=session_key,
        deadline=deadline,
        priority=request.priority,
        logprobs=request.response.logprobs or request.response.top_logprobs > 0,
        top_logprobs=request.response.top_logprobs,
        cache_salt=cache_salt,
        constraint=constraint_spec(request.constraint),
        prompt_field=_PROMPT_FIELDS.get(request.WhichOneof("input") or "", "input"),
        n=max(1, request.n),  # 0 (unset) means one
        adapter=request.adapter or None,  # empty: the base model
        prompt_logprobs=request.response.prompt_logprobs or request.response.prompt_top_logprobs > 0,
        prompt_top_logprobs=request.response.prompt_top_logprobs,
    )


def constraint_spec(constraint: pb.Constraint) -> ConstraintSpec | None:
    """The request's constraint as the engine takes it; None when unset (or json_object: false)."""
    kind = constraint.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not constraint.json_object):
        return None
    if kind == "choice":
        return ConstraintSpec(ConstraintKind.CHOICE, choices=tuple(constraint.choice.options))
    text = "" if kind == "json_object" else getattr(constraint, kind)
    return ConstraintSpec(ConstraintKind(kind), text)


def to_response(
    request_id: str, delta: Delta, options: pb.ResponseOptions, prompt_ids: Sequence[int]
) -> pb.GenerateResponse:
    """One stream message: the delta's text (and ids, logprobs when asked; on the first, the prompt's logprobs when
    asked), and on the last its finish facts; the completion it belongs to (index) and, on an n > 1 stream's very
    last, the whole request's usage."""
    response = pb.GenerateResponse(
        request_id=request_id, text=delta.text, prompt_token_ids=prompt_ids, index=delta.index
    )
    if options.token_ids:
        response.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        response.logprobs.extend(logprob_pb(lp) for lp in delta.logprobs)
    if delta.prompt_logprobs is not None:
        response.prompt_logprobs.extend(logprob_pb(lp) for lp in delta.prompt_logprobs)
    if delta.finish_reason is not None:
        response.finish_reason = pb.FinishReason.Value(  # type: ignore[assignment]  # the stubs want the enum type
            f"FINISH_REASON_{delta.finish_reason.name}"
        )
    for usage, target in ((delta.usage, response.usage), (delta.total_usage, response.total_usage)):
        if usage is not None:
            target.SetInParent()
            target.prompt_tokens = usage.prompt_tokens
            target.cached_prompt_tokens = usage.cached_prompt_tokens
            target.completion_tokens = usage.completion_tokens
    if delta.timing is not None:
        t = delta.timing
        response.timing.SetInParent()
        response.timing.queue_seconds = t.queue_s
        response.timing.time_to_first_token_seconds = t.ttft_s
        response.timing.total_seconds = t.total_s
    if delta.seed is not None:
        response.seed = delta.seed
    return response


def logprob_pb(lp: TokenLogprob) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top]
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_logprobs=top)


def input_text(request: pb.GenerateRequest) -> str:
    """The request's input for the request log (--log-prompts): clipped text or chat, or a count of ids."""
    kind = request.WhichOneof("input")
    if kind == "text":
        return clip(request.text, MAX_LOGGED_PROMPT_CHARS)
    if kind == "chat":
        return clip(" | ".join(f"{m.role}: {m.content}" for m in request.chat.messages), MAX_LOGGED_PROMPT_CHARS)
    return f"<{len(request.token_ids.ids)} token ids>"


# EmbedRequest.pooling to the engine's modes (POOLING_UNSPECIFIED: the model's).
_POOLING = {
    pb.POOLING_CLS: PoolingMode.CLS,
    pb.POOLING_MEAN: PoolingMode.MEAN,
    pb.POOLING_LAST: PoolingMode.LAST,
    pb.POOLING_MAX: PoolingMode.MAX,
}
POOLING_NAMES = {mode.value: value for value, mode in _POOLING.items()}  # ModelInfo.pooling -> pb.Pooling


def to_pooling_params(request: pb.EmbedRequest, info: ModelInfo) -> PoolingParams:
    """The engine's pooling for every input of an Embed call: the request's choices, else the model's defaults."""
    mode = _POOLING.get(request.pooling) or PoolingMode(info.pooling)
    normalize = request.normalize if request.HasField("normalize") else info.normalize
    dimensions = request.dimensions if request.HasField("dimensions") else None
    return PoolingParams(mode, normalize, dimensions)


def to_pooling_request(
    request: pb.EmbedRequest,
    index: int,
    prompt_ids: Sequence[int],
    *,
    request_id: str,
    pooling: PoolingParams,
    deadline: float | None = None,
) -> GenerationRequest:
    """The engine's request for input `index` of an Embed call (its own id: `request_id/index`): prefill only."""
    return GenerationRequest(
        deadline=deadline,
        request_id=f"{request_id}/{index}",
        prompt_token_ids=tuple(prompt_ids),
        stopping=StoppingParams(max_new_tokens=1),
        priority=request.priority,
        prompt_field=f"inputs[{index}]",
        pooling=pooling,
    )


def to_embedding(index: int, delta: Delta, truncated: bool, *, classify: bool = False) -> pb.Embedding:
    """One input's final delta as its Embedding; `classify`: its vector is a classifier's logits, whose
    probabilities (`probabilities`) fill `probabilities`."""
    usage = delta.usage
    values = delta.embedding or []
    return pb.Embedding(
        index=index,
        values=values,
        prompt_tokens=0 if usage is None else usage.prompt_tokens,
        truncated=truncated,
        probabilities=probabilities(values) if classify else [],
    )


def probabilities(logits: Sequence[float]) -> list[float]:
    """A classifier's class probabilities: the sigmoid of a single logit (a one-label model is a regression or
    relevance head: a softmax over one value is always 1.0; sentence-transformers' CrossEncoder and TEI apply the
    sigmoid), else the softmax of the logits."""
    if len(logits) == 1:
        return [sigmoid(logits[0])]
    return softmax(logits)


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x), without overflow for any float."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def softmax(logits: Sequence[float]) -> list[float]:
    """The class probabilities of a classifier's logits, shifted by their maximum so that no exponential overflows
    (classifier.probabilities in plain Python: the edge imports no torch)."""
    if not logits:
        return []
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]
