"""api/prompts.py on its own, over the real memory history store: a request's input as token ids (tokenizer, chat
template), and append mode's rules (which input continues which history, how the conversation is composed, the
per-session token cap, a missing or busy history). Append mode through a server: tests/service/test_conversations.py;
the stores' own contract: tests/test_history.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest

from llmserve.api.errors import ServiceError
from llmserve.api.prompts import SessionPrompts, chat_token_ids, prompt_token_ids
from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.outputs import Delta, FinishReason
from llmserve.history import HistoryConfig, MemoryHistoryStore, Turn
from llmserve_client import build_request, pb

BOS = 1


class Tokenizer:
    """Characters are tokens (their code points); a BOS unless told not to; a template that marks each role."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, turns, tokenize=True, add_generation_prompt=False):  # noqa: ANN001, ANN201
        if any(turn["role"] == "bot" for turn in turns):
            raise ValueError("roles must alternate user/assistant: " + "x" * 1000)
        assert add_generation_prompt and not tokenize
        return "".join(f"<{turn['role']}>{turn['content']}" for turn in turns) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) for c in text]


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def chat(*contents: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content} for content in contents]


def test_chat_input_without_a_chat_template_is_named() -> None:
    """A model without a chat template (or a tokenizer object without the attribute) refuses chat input, naming it
    and saying what to send instead; an empty conversation is refused before the template is asked."""
    messages = [pb.ChatMessage(role="user", content="hi")]
    for tokenizer in (SimpleNamespace(chat_template=None), SimpleNamespace()):
        with pytest.raises(InvalidRequest) as err:
            chat_token_ids(tokenizer, messages)
        assert (err.value.field, err.value.reason) == ("chat", "the model has no chat template: send text or token_ids")
    with pytest.raises(InvalidRequest) as err:
        chat_token_ids(SimpleNamespace(), [])
    assert (err.value.field, err.value.reason) == ("chat.messages", "must not be empty")


def test_a_chat_template_renders_the_ids_without_extra_special_tokens() -> None:
    """The template writes the special tokens it wants: its text is encoded without more (a tokenizer that would add a
    BOS by default adds none); a template that rejects the conversation is INVALID_ARGUMENT on chat.messages, its
    message clipped."""
    assert chat_token_ids(Tokenizer(), [pb.ChatMessage(role="user", content="hi")]) == ids("<user>hi<assistant>")
    with pytest.raises(InvalidRequest) as err:
        chat_token_ids(Tokenizer(), [pb.ChatMessage(role="bot", content="hi")])
    assert err.value.field == "chat.messages"
    assert err.value.reason.startswith("the chat template rejects it: roles must alternate user/assistant: xxx")
    assert len(err.value.reason) == len("the chat template rejects it: ") + 200 + len("...")


@pytest.mark.parametrize(
    ("request_pb", "tokenizer", "field", "reason"),
    [
        (pb.GenerateRequest(), Tokenizer(), "input", "set one of text, chat, token_ids"),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), Tokenizer(), "token_ids", "must not be empty"),
        (build_request(""), Tokenizer(), "text", "must not be empty"),
        (build_request("hi"), None, "text", "the model has no tokenizer: send token_ids"),
        (build_request(messages=chat("hi")), None, "chat", "the model has no tokenizer: send token_ids"),
    ],
)
async def test_an_input_that_cannot_become_ids_is_named(
    request_pb: pb.GenerateRequest, tokenizer: Tokenizer | None, field: str, reason: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        await prompt_token_ids(tokenizer, request_pb)
    assert (err.value.field, err.value.reason) == (field, reason)


async def test_each_input_becomes_its_ids() -> None:
    assert await prompt_token_ids(None, build_request(token_ids=[5, 6])) == [5, 6]
    assert await prompt_token_ids(Tokenizer(), build_request("hi")) == [BOS, *ids("hi")]  # text gets the BOS
    assert await prompt_token_ids(Tokenizer(), build_request(messages=chat("hi"))) == ids("<user>hi<assistant>")
    assert await prompt_token_ids(Tokenizer(), pb.TokenizeRequest(text="hi")) == [BOS, *ids("hi")]


def test_continued_prompt_over_the_token_cap_is_refused_naming_the_flag() -> None:
    prompts = SessionPrompts(MemoryHistoryStore(HistoryConfig()), max_tokens=5)
    prompts.check_length(5)
    with pytest.raises(InvalidRequest, match="--max-session-tokens") as err:
        prompts.check_length(6)
    assert err.value.field == "continue_session"


@pytest.fixture
async def prompts() -> AsyncIterator[SessionPrompts]:
    store = MemoryHistoryStore(HistoryConfig())
    yield SessionPrompts(store, max_tokens=100)
    await store.close()


async def answered(turn: Turn | None, answer: str) -> None:
    """The answer as the servicer feeds it to the turn (its ids, and its text on the last delta), then released."""
    assert turn is not None
    try:
        await turn.observe(Delta("r", ids(answer), answer, finish_reason=FinishReason.EOS))
    finally:
        await turn.release()


async def call(prompts: SessionPrompts, request: pb.GenerateRequest, request_id: str = "r") -> tuple[list[int], Turn]:
    prompt, turn = await prompts.prompt(Tokenizer(), request, request_id, request.session_id or None)
    assert turn is not None
    return prompt, turn


async def test_a_chat_continues_with_the_held_messages_and_the_answer_rendered_again(prompts: SessionPrompts) -> None:
    first, turn = await call(prompts, build_request(messages=chat("Hi"), session_id="s"))
    assert first == ids("<user>Hi<assistant>")
    await answered(turn, "Yo")
    second, turn = await call(prompts, build_request(messages=chat("Bye"), session_id="s", continue_session=True))
    assert second == ids("<user>Hi<assistant>Yo<user>Bye<assistant>")
    await answered(turn, "Ok")


async def test_text_and_token_ids_continue_the_held_ids(prompts: SessionPrompts) -> None:
    first, turn = await call(prompts, build_request("ab", session_id="t"))
    assert first == [BOS, *ids("ab")]
    await answered(turn, "c")
    # New text gets no special tokens: it goes on in the middle of a conversation.
    second, turn = await call(prompts, build_request("d", session_id="t", continue_session=True))
    assert second == [BOS, *ids("abcd")]
    await answered(turn, "e")
    third, turn = await call(prompts, build_request(token_ids=[7], session_id="t", continue_session=True))
    assert third == [BOS, *ids("abcde"), 7]
    await turn.release()


@pytest.mark.parametrize(
    ("held", "new", "field"),
    [
        (build_request(messages=chat("Hi"), session_id="k"), build_request(token_ids=[7]), "token_ids"),
        (build_request(messages=chat("Hi"), session_id="k"), build_request("more"), "text"),
        (build_request("Hi", session_id="k"), build_request(messages=chat("Bye")), "chat"),
        (build_request("Hi", session_id="k"), build_request(messages=[]), "chat.messages"),
        (build_request("Hi", session_id="k"), pb.GenerateRequest(text=""), "text"),
        (build_request("Hi", session_id="k"), pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
    ],
)
async def test_kinds_do_not_mix_and_an_empty_new_turn_is_named(
    prompts: SessionPrompts, held: pb.GenerateRequest, new: pb.GenerateRequest, field: str
) -> None:
    _, turn = await call(prompts, held)
    await answered(turn, "Yo")
    new.session_id, new.continue_session = "k", True
    with pytest.raises(InvalidRequest) as err:
        await prompts.prompt(Tokenizer(), new, "r2", "k")
    assert err.value.field == field
    _, again = await call(prompts, build_request(token_ids=[1], session_id="k"))  # the refused turn let go
    await again.release()


async def test_append_mode_needs_a_session_and_a_history(prompts: SessionPrompts) -> None:
    with pytest.raises(InvalidRequest) as err:
        await prompts.prompt(Tokenizer(), build_request("hi", continue_session=True), "r", None)
    assert (err.value.field, err.value.reason) == ("session_id", "must be set with continue_session")
    with pytest.raises(ServiceError) as missing:
        await prompts.prompt(Tokenizer(), build_request("hi", session_id="nope", continue_session=True), "r", "k1")
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert missing.value.message.startswith("session 'nope' holds no history to continue")
    plain, turn = await prompts.prompt(Tokenizer(), build_request(token_ids=[3]), "r", None)
    assert (plain, turn) == ([3], None)  # no session: no history


async def test_a_second_continuing_call_is_aborted_naming_the_first(prompts: SessionPrompts) -> None:
    _, turn = await call(prompts, build_request("a", session_id="b"))
    await answered(turn, "b")
    _, running = await call(prompts, build_request("c", session_id="b", continue_session=True), "first")
    with pytest.raises(ServiceError) as err:
        await prompts.prompt(Tokenizer(), build_request("d", session_id="b", continue_session=True), "second", "b")
    assert err.value.code == grpc.StatusCode.ABORTED and "request 'first'" in err.value.message
    await running.release()


async def test_a_continued_prompt_over_the_cap_is_refused_and_lets_the_session_go(prompts: SessionPrompts) -> None:
    _, turn = await call(prompts, build_request("x" * 90, session_id="c"))
    await answered(turn, "y")
    with pytest.raises(InvalidRequest) as err:
        await prompts.prompt(Tokenizer(), build_request("z" * 20, session_id="c", continue_session=True), "r", "c")
    assert err.value.field == "continue_session" and "(100)" in err.value.reason
    ok, turn = await call(prompts, build_request("z", session_id="c", continue_session=True))
    assert len(ok) == 1 + 90 + 1 + 1
    await turn.release()
