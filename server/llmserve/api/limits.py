"""The sizes a caller may send (ids, inputs, stop lists, bias and constraint entries), each bounded by a flag
and checked at the edge before any tokenizer or engine work.

Each check raises `InvalidRequest(field, reason)` naming the request field and the limit (and the flag that
sets it). Error messages quote at most a short, escaped prefix of what the caller sent (`quote_prefix`).
Values (sampling ranges, token ids against the vocabulary, top_logprobs) are the engine request types'
to check (`GenerationRequest.validate`), each in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.config import InputLimits
from llmserve.engine.types.errors import InvalidRequest
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb

PREFIX_CHARS = 32
# Without --max-prompt-bytes: this many UTF-8 bytes per token of context. Real text runs 3-5 bytes a token;
# 16 leaves room for long whitespace or symbol runs while bounding tokenizer work by the context.
PROMPT_BYTES_PER_TOKEN = 16
# An Embed text with `truncate` set is never refused for its size: it is cut at this many UTF-8 bytes per token the
# model takes (max_embed_input_tokens) before tokenizing. Real text runs 3-5 bytes a token, so the cut holds several
# times the tokens truncation keeps, and a word the cut splits sits far past them; only a text averaging over 32
# bytes a token (long runs of symbols) embeds fewer tokens than the limit: those of its first (or last) bytes.
TRUNCATE_BYTES_PER_TOKEN = 32


def quote_prefix(value: str, limit: int = PREFIX_CHARS) -> str:
    """`value` for an error message or log: escaped (ASCII only), its escaped form cut to about 2 x `limit`."""
    n = min(len(value), limit)
    while n and len(ascii(value[:n])) > 2 * limit + 2:  # escapes (\x1f, \U0001f600) run up to 10 per character
        n //= 2
    if n == len(value):
        return ascii(value)
    return f"{ascii(value[:n])}... ({len(value)} characters)"


def prompt_byte_limit(limits: InputLimits, context_length: int) -> int:
    """The largest text or chat input in UTF-8 bytes: the flag, or PROMPT_BYTES_PER_TOKEN per token of context."""
    return limits.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * context_length


def truncation_byte_bound(max_input_tokens: int) -> int:
    """The UTF-8 bytes of an Embed text that truncation tokenizes: TRUNCATE_BYTES_PER_TOKEN per token it keeps."""
    return TRUNCATE_BYTES_PER_TOKEN * max_input_tokens


def cut_utf8(text: str, max_bytes: int, keep_end: bool) -> tuple[str, bool]:
    """`text`'s first (or, with `keep_end`, last) `max_bytes` UTF-8 bytes, cut on a character boundary, and whether
    anything was cut. Encodes at most 4 x `max_bytes` characters, whatever the text's length."""
    if len(text) <= max_bytes // 4:  # at most 4 bytes a character: it fits
        return text, False
    part = text[-max_bytes:] if keep_end else text[:max_bytes]  # at least max_bytes bytes when longer
    raw = part.encode("utf-8", "surrogatepass")
    if len(raw) <= max_bytes and len(part) == len(text):
        return text, False
    raw = raw[-max_bytes:] if keep_end else raw[:max_bytes]
    # A character the byte cut split is dropped whole: its continuation bytes at the start, its lead at the end.
    if keep_end:
        start = 0
        while start < len(raw) and raw[start] & 0xC0 == 0x80:
            start += 1
        return raw[start:].decode("utf-8", "surrogatepass"), True
    lead = len(raw) - 1
    while lead > 0 and raw[lead] & 0xC0 == 0x80:
        lead -= 1
    end = len(raw) if lead + _utf8_sequence_length(raw[lead]) <= len(raw) else lead
    return raw[:end].decode("utf-8", "surrogatepass"), True


def _utf8_sequence_length(lead: int) -> int:
    """The bytes of the character whose first byte is `lead`."""
    return 1 if lead < 0x80 else 4 if lead >= 0xF0 else 3 if lead >= 0xE0 else 2


def is_valid_id(value: str, max_length: int) -> bool:
    return len(value) <= max_length and value.isprintable()


def check_id(field: str, value: str, max_length: int, flag: str) -> None:
    """An identifier: at most `max_length` characters, all printable (no control characters, no line breaks)."""
    if len(value) > max_length:
        raise InvalidRequest(field, f"is {len(value)} characters, the limit is {max_length} ({flag})")
    if not value.isprintable():
        raise InvalidRequest(field, "must be printable characters (no control characters or line breaks)")


def check_generate(request: pb.GenerateRequest, limits: InputLimits, max_prompt_bytes: int) -> None:
    """The sizes of everything a GenerateRequest carries, before the tokenizer or the engine sees it."""
    check_id("request_id", request.request_id, limits.max_request_id_length, "--max-request-id-length")
    check_id("session_id", request.session_id, limits.max_session_id_length, "--max-session-id-length")
    check_input(request, limits, max_prompt_bytes)
    stopping = request.stopping
    stops = stopping.stop_sequences
    if len(stops) > limits.max_stop_sequences:
        raise InvalidRequest(
            "stopping.stop_sequences",
            f"has {len(stops)} entries, the limit is {limits.max_stop_sequences} (--max-stop-sequences)",
        )
    chars = sum(len(stop) for stop in stops)
    if chars > limits.max_stop_sequences_chars:
        raise InvalidRequest(
            "stopping.stop_sequences",
            f"are {chars} characters together, the limit is {limits.max_stop_sequences_chars} "
            "(--max-stop-sequences-chars)",
        )
    if len(stopping.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(
            "stopping.stop_token_ids",
            f"has {len(stopping.stop_token_ids)} entries, the limit is {limits.max_stop_token_ids} "
            "(--max-stop-token-ids)",
        )
    bias = request.sampling.logit_bias
    if len(bias) > limits.max_logit_bias:
        raise InvalidRequest(
            "sampling.logit_bias",
            f"has {len(bias)} entries, the limit is {limits.max_logit_bias} (--max-logit-bias)",
        )
    _check_constraint(request.constraint, limits.max_constraint_chars)


def _check_constraint(constraint: pb.Constraint, max_chars: int) -> None:
    """A constraint's size: its text, or all its choices together, in characters (before any compiling)."""
    kind = constraint.WhichOneof("kind")
    if kind in ("json_schema", "regex", "grammar"):
        text = getattr(constraint, kind)
        if not text:
            raise InvalidRequest(f"constraint.{kind}", "must not be empty")
        if len(text) > max_chars:
            raise InvalidRequest(
                f"constraint.{kind}", f"is {len(text)} characters, the limit is {max_chars} (--max-constraint-chars)"
            )
    elif kind == "choice":
        options = constraint.choice.options
        if not options:
            raise InvalidRequest("constraint.choice.options", "must not be empty")
        if any(not option for option in options):
            raise InvalidRequest("constraint.choice.options", "must not contain an empty string")
        chars = sum(len(option) for option in options)
        if chars > max_chars:
            raise InvalidRequest(
                "constraint.choice.options",
                f"are {chars} characters together, the limit is {max_chars} (--max-constraint-chars)",
            )


def check_input(request: pb.GenerateRequest | pb.TokenizeRequest, limits: InputLimits, max_prompt_bytes: int) -> None:
    """The size of a text or chat input in bytes, and a chat's message count and roles."""
    kind = request.WhichOneof("input")
    if kind == "text":
        check_prompt_bytes("text", request.text, max_prompt_bytes)
    elif kind == "chat":
        _check_chat("chat", request.chat.messages, limits, max_prompt_bytes)


def _check_chat(field: str, messages: Sequence[pb.ChatMessage], limits: InputLimits, max_prompt_bytes: int) -> None:
    if len(messages) > limits.max_chat_messages:
        raise InvalidRequest(
            f"{field}.messages",
            f"has {len(messages)} messages, the limit is {limits.max_chat_messages} (--max-chat-messages)",
        )
    total = 0
    for i, message in enumerate(messages):
        if message.role not in limits.chat_roles:
            raise InvalidRequest(
                f"{field}.messages[{i}].role",
                f"{quote_prefix(message.role)} is not one of {', '.join(limits.chat_roles)} (--chat-roles)",
            )
        total += _utf8_length(message.content, max_prompt_bytes - total)
        if total > max_prompt_bytes:
            raise InvalidRequest(
                f"{field}.messages", f"are over {max_prompt_bytes} bytes of content, the limit (--max-prompt-bytes)"
            )


def check_prompt_bytes(field: str, text: str, max_prompt_bytes: int) -> None:
    """A text input's UTF-8 size against --max-prompt-bytes, InvalidRequest naming `field` when over."""
    if _utf8_length(text, max_prompt_bytes) > max_prompt_bytes:
        raise InvalidRequest(field, f"is over {max_prompt_bytes} bytes, the limit (--max-prompt-bytes)")


def _utf8_length(text: str, limit: int) -> int:
    """UTF-8 length of `text`, or just something over `limit` when it is certainly longer (no encoding)."""
    if len(text) > limit:  # every character is at least one byte
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def check_classify(request: pb.EmbedRequest) -> None:
    """An Embed call on a classifier sets none of the vector's options: its vector is the head's logits, whose
    length is the number of classes and whose token the head fixes."""
    for name in ("normalize", "dimensions"):
        if request.HasField(name):
            raise InvalidRequest(name, "not allowed with a classifier: Embed returns its logits as they are")
    if request.pooling != pb.POOLING_UNSPECIFIED:
        raise InvalidRequest("pooling", "not allowed with a classifier: its head reads the token it was trained on")


def check_embed(request: pb.EmbedRequest, limits: InputLimits, max_prompt_bytes: int, embedding_size: int) -> None:
    """The sizes and ranges of an Embed call, before any tokenizer or engine work: at least one input and at most
    --max-embed-inputs, each with one input set and within the byte and chat limits (a text only without
    `truncate`: with it, the text is cut at truncation_byte_bound before tokenizing); `dimensions` within the
    model's `embedding_size`; known enum values."""
    check_id("request_id", request.request_id, limits.max_request_id_length, "--max-request-id-length")
    inputs = request.inputs
    if not inputs:
        raise InvalidRequest("inputs", "must not be empty")
    if len(inputs) > limits.max_embed_inputs:
        raise InvalidRequest(
            "inputs", f"has {len(inputs)} inputs, the limit is {limits.max_embed_inputs} (--max-embed-inputs)"
        )
    if request.HasField("dimensions") and not 1 <= request.dimensions <= embedding_size:
        raise InvalidRequest("dimensions", f"must be in [1, {embedding_size}], got {request.dimensions}")
    if request.truncate not in pb.Truncation.values():
        raise InvalidRequest("truncate", f"unknown value {request.truncate}")
    if request.pooling not in pb.Pooling.values():
        raise InvalidRequest("pooling", f"unknown value {request.pooling}")
    if request.HasField("prompt"):
        if request.HasField("prompt_name"):
            raise InvalidRequest("prompt", "set prompt or prompt_name, not both")
        check_prompt_bytes("prompt", request.prompt, max_prompt_bytes)
    for i, item in enumerate(inputs):
        field = f"inputs[{i}]"
        kind = item.WhichOneof("input")
        if kind is None:
            raise InvalidRequest(field, "set one of text, chat, token_ids")
        if kind == "text":
            if not item.text:
                raise InvalidRequest(f"{field}.text", "must not be empty")
            if request.truncate == pb.TRUNCATION_UNSPECIFIED:  # truncated texts are cut (cut_utf8), never refused
                check_prompt_bytes(f"{field}.text", item.text, max_prompt_bytes)
        elif kind == "token_ids":
            if not item.token_ids.ids:
                raise InvalidRequest(f"{field}.token_ids.ids", "must not be empty")
        else:
            _check_chat(f"{field}.chat", item.chat.messages, limits, max_prompt_bytes)
