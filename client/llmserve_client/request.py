"""Building GenerateRequest and EmbedRequest messages from plain Python arguments (shared by the sync and async
clients)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb

Message = Mapping[str, str] | tuple[str, str] | pb.ChatMessage
# One input of an EmbedRequest: a text, a list of token ids, a conversation (a list of messages, or a ChatInput),
# or a ready EmbedInput.
EmbedItem = str | Sequence[int] | Sequence[Message] | pb.ChatInput | pb.EmbedInput
TRUNCATIONS: dict[str, pb.Truncation] = {"keep_start": pb.TRUNCATION_KEEP_START, "keep_end": pb.TRUNCATION_KEEP_END}
POOLINGS: dict[str, pb.Pooling] = {
    "cls": pb.POOLING_CLS,
    "mean": pb.POOLING_MEAN,
    "last": pb.POOLING_LAST,
    "max": pb.POOLING_MAX,
}
E = TypeVar("E")


def chat_input(messages: Iterable[Message]) -> pb.ChatInput:
    """A ChatInput from {"role": ..., "content": ...} dicts, (role, content) pairs or ChatMessage protos."""
    chat = pb.ChatInput()
    for m in messages:
        if isinstance(m, pb.ChatMessage):
            chat.messages.append(m)
        elif isinstance(m, Mapping):
            chat.messages.add(role=m["role"], content=m["content"])
        else:
            role, content = m
            chat.messages.add(role=role, content=content)
    return chat


def build_request(
    prompt: str | None = None,
    *,
    messages: Iterable[Message] | None = None,
    token_ids: Sequence[int] | None = None,
    request_id: str = "",
    session_id: str = "",
    continue_session: bool = False,
    max_new_tokens: int | None = None,
    min_new_tokens: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    include_stop_sequence: bool = False,
    ignore_eos: bool = False,
    return_token_ids: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    return_prompt_token_ids: bool = False,
    prompt_logprobs: bool = False,
    prompt_top_logprobs: int = 0,
    priority: int = 0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    json_schema: str | Mapping[str, object] | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    n: int = 1,
    adapter: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest; exactly one of `prompt` (text), `messages` (chat) or `token_ids` must be given.

    Arguments left at their defaults leave the field unset, so the server's defaults apply (greedy,
    the server's max_new_tokens). The server validates ranges; see generate.proto for each field.
    `continue_session` (with `session_id`) sends only the new turn: the server prepends the session's history.
    At most one constraint: `json_schema` (text, or a dict sent as JSON), `json_object`, `regex`, `grammar`
    (llguidance's Lark syntax) or `choice` (the allowed answers). `n` > 1 asks for n completions of the prompt on
    one stream, told apart by each response's `index` (`texts_by_index` joins them). `adapter`: the LoRA adapter
    to generate with, by the name the server loaded it under (empty: the base model). `prompt_logprobs` (and
    `prompt_top_logprobs` alternatives) returns each prompt token's log-probability on the first response
    (`prompt_logprobs`): how a caller scores a text; the prompt is then computed whole, reading no cached state.
    """
    inputs = {"prompt": prompt, "messages": messages, "token_ids": token_ids}
    given = [name for name, value in inputs.items() if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages or token_ids (got {', '.join(given) or 'none'})")
    request = pb.GenerateRequest(
        request_id=request_id,
        session_id=session_id,
        continue_session=continue_session,
        priority=priority,
        adapter=adapter,
    )
    if n != 1:
        request.n = n  # 0 and 1 both mean one: left unset; a negative n is the caller's error (ValueError)
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.chat.CopyFrom(chat_input(messages))
    else:
        request.token_ids.ids.extend(token_ids)

    s = request.sampling
    s.temperature = temperature
    s.top_k = top_k
    s.min_p = min_p
    if top_p is not None:
        s.top_p = top_p
    if repetition_penalty is not None:
        s.repetition_penalty = repetition_penalty
    if seed is not None:
        s.seed = seed
    s.frequency_penalty = frequency_penalty
    s.presence_penalty = presence_penalty
    if logit_bias:
        s.logit_bias.update(logit_bias)
    _set_constraint(request.constraint, json_schema, json_object, regex, grammar, choice)

    st = request.stopping
    if max_new_tokens is not None:
        st.max_new_tokens = max_new_tokens
    st.min_new_tokens = min_new_tokens
    st.stop_sequences.extend(stop)
    st.stop_token_ids.extend(stop_token_ids)
    st.include_stop_sequence = include_stop_sequence
    st.ignore_eos = ignore_eos

    r = request.response
    r.token_ids = return_token_ids
    r.logprobs = logprobs
    r.top_logprobs = top_logprobs
    r.prompt_token_ids = return_prompt_token_ids
    r.prompt_logprobs = prompt_logprobs
    r.prompt_top_logprobs = prompt_top_logprobs
    return request


def _set_constraint(
    constraint: pb.Constraint,
    json_schema: str | Mapping[str, object] | None,
    json_object: bool,
    regex: str | None,
    grammar: str | None,
    choice: Sequence[str] | None,
) -> None:
    given = {
        name: value
        for name, value in (
            ("json_schema", json_schema),
            ("json_object", json_object or None),
            ("regex", regex),
            ("grammar", grammar),
            ("choice", choice),
        )
        if value is not None
    }
    if len(given) > 1:
        raise ValueError(f"give at most one constraint (got {', '.join(given)})")
    if json_schema is not None:
        constraint.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        constraint.json_object = True
    elif regex is not None:
        constraint.regex = regex
    elif grammar is not None:
        constraint.grammar = grammar
    elif choice is not None:
        constraint.choice.options.extend(choice)


def texts_by_index(responses: Iterable[pb.GenerateResponse]) -> list[str]:
    """The whole text of each completion of a stream, by GenerateResponse.index (one entry when n was 1)."""
    texts: list[str] = []
    for response in responses:
        while len(texts) <= response.index:
            texts.append("")
        texts[response.index] += response.text
    return texts


def tokenize_request(text: str | None = None, *, messages: Iterable[Message] | None = None) -> pb.TokenizeRequest:
    """A TokenizeRequest for text or a conversation (exactly one)."""
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text or messages")
    if messages is None:
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(chat=chat_input(messages))


def embed_request(
    inputs: str | Iterable[EmbedItem],
    *,
    normalize: bool | None = None,
    dimensions: int | None = None,
    truncate: str | None = None,
    pooling: str | None = None,
    request_id: str = "",
    priority: int = 0,
    prompt_name: str | None = None,
    prompt: str | None = None,
) -> pb.EmbedRequest:
    """An EmbedRequest for one text (`inputs` a str) or a batch of inputs, each a text, a list of token ids, a
    conversation (a list of {"role", "content"} dicts, (role, content) pairs or ChatMessages; or a ChatInput) or
    an EmbedInput.

    Arguments left at None leave the field unset, so the model's defaults apply. `truncate`: "keep_start" or
    "keep_end" keeps that end of a too-long input (None: a too-long input is refused). `pooling`: "cls", "mean",
    "last" or "max". `prompt_name`: one of the model's instruction prompts (GetModelInfo's prompt_names);
    `prompt`: a prompt of one's own ("": none, not even the model's default). The server validates the rest (see
    generate.proto); ValueError for an unknown truncate or
    pooling name, TypeError for an input of none of the kinds above.
    """
    request = pb.EmbedRequest(request_id=request_id, priority=priority)
    items: Iterable[EmbedItem] = [inputs] if isinstance(inputs, str) else inputs
    request.inputs.extend(embed_input(item) for item in items)
    if normalize is not None:
        request.normalize = normalize
    if dimensions is not None:
        request.dimensions = dimensions
    if truncate is not None:
        request.truncate = _named(TRUNCATIONS, truncate, "truncate")
    if pooling is not None:
        request.pooling = _named(POOLINGS, pooling, "pooling")
    if prompt_name is not None:
        request.prompt_name = prompt_name
    if prompt is not None:
        request.prompt = prompt
    return request


def embed_input(item: EmbedItem) -> pb.EmbedInput:
    """One EmbedInput from a text, token ids, a conversation or an EmbedInput (see embed_request)."""
    if isinstance(item, pb.EmbedInput):
        return item
    if isinstance(item, str):
        return pb.EmbedInput(text=item)
    if isinstance(item, pb.ChatInput):
        return pb.EmbedInput(chat=item)
    if isinstance(item, Sequence) and not isinstance(item, (bytes, bytearray)):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            return pb.EmbedInput(token_ids=pb.TokenIds(ids=list(item)))  # type: ignore[arg-type]
        if all(isinstance(m, (Mapping, tuple, pb.ChatMessage)) for m in item):
            return pb.EmbedInput(chat=chat_input(item))  # type: ignore[arg-type]
    raise TypeError(
        f"an embed input is a text, a list of token ids or a list of chat messages, not {type(item).__name__}"
        " (several inputs go in a list: [[1, 2, 3], [4, 5]])"
    )


def _named(table: Mapping[str, E], name: str, what: str) -> E:
    value = table.get(name.replace("-", "_").lower())
    if value is None:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return value
