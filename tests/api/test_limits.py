"""api/limits.py on its own: each size a request carries, accepted at its limit and refused one past it, naming the
field and the flag; what an error message quotes of the caller's input. Every limit through a server, before any
tokenizer work: tests/service/test_input_limits.py."""

from __future__ import annotations

import pytest

from llmserve.api.limits import (
    PREFIX_CHARS,
    PROMPT_BYTES_PER_TOKEN,
    check_classify,
    check_generate,
    check_id,
    check_input,
    cut_utf8,
    prompt_byte_limit,
    quote_prefix,
)
from llmserve.config import InputLimits
from llmserve.engine.types.errors import InvalidRequest
from llmserve_client import build_request, pb

LIMITS = InputLimits(
    max_request_id_length=8, max_session_id_length=8, max_stop_sequences=2, max_stop_sequences_chars=10,
    max_stop_token_ids=2, max_chat_messages=2, chat_roles=("user", "assistant"), max_logit_bias=2,
    max_constraint_chars=10,
)  # fmt: skip
PROMPT_BYTES = 20


def refusal(request: pb.GenerateRequest) -> tuple[str, str]:
    with pytest.raises(InvalidRequest) as err:
        check_generate(request, LIMITS, PROMPT_BYTES)
    return err.value.field, err.value.reason


def with_bias(entries: int) -> pb.GenerateRequest:
    request = build_request("hi")
    for token_id in range(entries):
        request.sampling.logit_bias[token_id] = 1.0
    return request


AT_THE_LIMIT = [
    build_request("hi", request_id="r" * 8, session_id="s" * 8),
    build_request("hi", stop=["abcde", "fghij"], stop_token_ids=[1, 2]),
    build_request("x" * PROMPT_BYTES),
    build_request("é" * (PROMPT_BYTES // 2)),
    build_request(messages=[{"role": "user", "content": "x" * 10}, {"role": "assistant", "content": "y" * 10}]),
    with_bias(2),
    pb.GenerateRequest(text="hi", constraint=pb.Constraint(regex="[a-z]{1,5}")),
    pb.GenerateRequest(text="hi", constraint=pb.Constraint(choice=pb.Choice(options=["yes", "no", "maybe"]))),
    pb.GenerateRequest(text="hi", constraint=pb.Constraint(json_object=True)),
]


@pytest.mark.parametrize("request_pb", AT_THE_LIMIT, ids=range(len(AT_THE_LIMIT)))
def test_a_request_at_every_limit_is_accepted(request_pb: pb.GenerateRequest) -> None:
    check_generate(request_pb, LIMITS, PROMPT_BYTES)


PAST_THE_LIMIT = [
    (build_request("hi", request_id="r" * 9), "request_id", "--max-request-id-length"),
    (build_request("hi", session_id="s" * 9), "session_id", "--max-session-id-length"),
    (build_request("hi", request_id="a\u2028b"), "request_id", "printable"),
    (build_request("hi", stop=["a", "b", "c"]), "stopping.stop_sequences", "--max-stop-sequences"),
    (build_request("hi", stop=["abcdef", "ghijk"]), "stopping.stop_sequences", "--max-stop-sequences-chars"),
    (build_request("hi", stop_token_ids=[1, 2, 3]), "stopping.stop_token_ids", "--max-stop-token-ids"),
    (with_bias(3), "sampling.logit_bias", "--max-logit-bias"),
    (build_request("x" * (PROMPT_BYTES + 1)), "text", "--max-prompt-bytes"),
    (build_request("é" * (PROMPT_BYTES // 2) + "x"), "text", "--max-prompt-bytes"),  # bytes, not characters
    (build_request(messages=[{"role": "user", "content": "hi"}] * 3), "chat.messages", "--max-chat-messages"),
    (build_request(messages=[{"role": "system", "content": "hi"}]), "chat.messages[0].role", "--chat-roles"),
    (
        build_request(messages=[{"role": "user", "content": "x" * 11}, {"role": "user", "content": "y" * 10}]),
        "chat.messages",
        "--max-prompt-bytes",
    ),
    (pb.GenerateRequest(text="hi", constraint=pb.Constraint(json_schema="")), "constraint.json_schema", "empty"),
    (pb.GenerateRequest(text="hi", constraint=pb.Constraint(regex="x" * 11)), "constraint.regex", "--max-constraint"),
    (pb.GenerateRequest(text="hi", constraint=pb.Constraint(grammar="x" * 11)), "constraint.grammar", "--max-constr"),
    (
        pb.GenerateRequest(text="hi", constraint=pb.Constraint(choice=pb.Choice())),
        "constraint.choice.options",
        "must not be empty",
    ),
    (
        pb.GenerateRequest(text="hi", constraint=pb.Constraint(choice=pb.Choice(options=["yes", ""]))),
        "constraint.choice.options",
        "empty string",
    ),
    (
        pb.GenerateRequest(text="hi", constraint=pb.Constraint(choice=pb.Choice(options=["yes", "no", "maybe?"]))),
        "constraint.choice.options",
        "--max-constraint-chars",
    ),
]


@pytest.mark.parametrize(
    ("request_pb", "field", "says"), PAST_THE_LIMIT, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(PAST_THE_LIMIT)]
)
def test_one_past_a_limit_is_refused_naming_the_field_and_the_limit(
    request_pb: pb.GenerateRequest, field: str, says: str
) -> None:
    named, reason = refusal(request_pb)
    assert named == field and says in reason, reason


def test_a_tokenize_request_is_bounded_like_a_generate_one() -> None:
    check_input(pb.TokenizeRequest(text="x" * PROMPT_BYTES), LIMITS, PROMPT_BYTES)
    with pytest.raises(InvalidRequest) as err:
        check_input(pb.TokenizeRequest(text="x" * (PROMPT_BYTES + 1)), LIMITS, PROMPT_BYTES)
    assert err.value.field == "text"


def test_identifiers_and_the_prompt_byte_limit() -> None:
    check_id("request_id", "abc-123_ü", 16, "--flag")
    for bad in ("tab\there", "line\nbreak", "nul\x00"):
        with pytest.raises(InvalidRequest, match="printable"):
            check_id("request_id", bad, 16, "--flag")
    assert prompt_byte_limit(InputLimits(max_prompt_bytes=1000), 4096) == 1000
    assert prompt_byte_limit(InputLimits(), 4096) == PROMPT_BYTES_PER_TOKEN * 4096


def test_a_quoted_prefix_is_short_escaped_and_says_how_long_the_whole_was() -> None:
    assert quote_prefix("s1") == "'s1'"
    assert quote_prefix("a\nb") == "'a\\nb'"  # no line break reaches a log line
    long = quote_prefix("x" * 1000)
    assert long == f"{'x' * PREFIX_CHARS!r}... (1000 characters)"
    for value in ("\U0001f600" * 1000, "\x1f" * 1000, "é" * 1000):
        quoted = quote_prefix(value)
        assert quoted.isascii() and len(quoted) <= 2 * PREFIX_CHARS + 2 + len("... (1000 characters)"), quoted


@pytest.mark.parametrize(
    ("field", "options"),
    [("normalize", {"normalize": True}), ("dimensions", {"dimensions": 2}), ("pooling", {"pooling": pb.POOLING_CLS})],
)
def test_a_classifiers_embed_sets_none_of_the_vectors_options(field: str, options: dict[str, object]) -> None:
    check_classify(pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")]))
    with pytest.raises(InvalidRequest) as err:
        check_classify(pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], **options))  # type: ignore[arg-type]
    assert err.value.field == field


@pytest.mark.parametrize(
    ("text", "max_bytes", "keep_end", "want"),
    [
        ("abc", 3, False, ("abc", False)),
        ("abcd", 3, False, ("abc", True)),
        ("abcd", 3, True, ("bcd", True)),
        ("a🙂b", 4, False, ("a", True)),  # the emoji's four bytes do not fit after "a": dropped whole
        ("a🙂b", 5, False, ("a🙂", True)),
        ("a🙂b", 4, True, ("b", True)),
        ("é世🙂", 9, True, ("é世🙂", False)),
        ("é世🙂", 8, True, ("世🙂", True)),
        ("é世🙂", 8, False, ("é世", True)),
        ("é世🙂", 4, False, ("é", True)),
    ],
)
def test_a_truncated_embed_text_is_cut_on_a_character_boundary(
    text: str, max_bytes: int, keep_end: bool, want: tuple[str, bool]
) -> None:
    assert cut_utf8(text, max_bytes, keep_end) == want
