"""Append mode through gRPC (issue 15): a call sends only its new turn and the server prepends the session's
history. Greedy outputs must equal the stateless full resend's, token for token, also after the session's KV
was evicted between turns; the history's limits, errors and concurrency are those documented in the proto."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from harness import CONTEXT_LENGTH, TINY_LLAMA, ServerThread, smollm2_tokenizer, tiny_engine, tiny_model, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_service_errors import _empty_token_ids, _status

from llmserve.api.limits import quote_prefix
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.history import HistoryConfig
from llmserve_client import Client, build_request, pb

# A pool of 1,024 tokens (the context): a 1,023-token filler prompt plus its one new token needs all of it,
# so it evicts every idle session.
POOL_TOKENS = 1024
FILLER = list(range(1000, 2023))
BOS = TINY_LLAMA["bos_token_id"]


@pytest.fixture(scope="module")
def small_pool() -> Iterator[ServerThread]:
    srv = ServerThread(tiny_engine(kv_cache_tokens=POOL_TOKENS)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(small_pool: ServerThread) -> Iterator[Client]:
    with Client(small_pool.address, timeout=120) as c:
        yield c


def run(client: Client, request: pb.GenerateRequest) -> tuple[list[int], str, pb.GenerateResponse]:
    """(generated ids, text, last message) of one call; the request must ask for token ids."""
    responses = list(client.generate(request))
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses), responses[-1]


def evict_idle_sessions(client: Client, server: ServerThread, session_id: str) -> None:
    """Push every idle session's KV out of the small pool; the history stays."""
    client.generate_text(token_ids=FILLER, max_new_tokens=1, ignore_eos=True)
    held = client.get_session(session_id)
    assert held is not None and held.cached_tokens == 0 and held.history_tokens > 0, held


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


text_st = st.text(alphabet="abcdefghij klmnopqrstuvwxyz,.?!ABCÉ", min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system=st.none() | text_st,
    turns=st.lists(st.tuples(text_st, st.integers(1, 10), st.booleans()), min_size=2, max_size=4),
)
def test_chat_append_equals_full_resend(
    client: Client, small_pool: ServerThread, system: str | None, turns: list[tuple[str, int, bool]]
) -> None:
    """Random multi-turn chats: each append-mode turn gets the prompt and tokens of the full resend, whether the
    session's KV survived (each `evict` flag pushes it out of the pool before that turn)."""
    session = new_session()
    history = [("system", system)] if system is not None else []
    for i, (message, max_new, evict) in enumerate(turns):
        if i > 0 and evict:
            evict_idle_sessions(client, small_pool, session)
        history.append(("user", message))
        options = dict(max_new_tokens=max_new, return_token_ids=True, return_prompt_token_ids=True)
        full = build_request(messages=history, **options)
        if i == 0:
            append = build_request(messages=history, session_id=session, **options)
        else:
            append = build_request(messages=[history[-1]], session_id=session, continue_session=True, **options)
        ids, text, last = run(client, append)
        full_ids, full_text, full_last = run(client, full)
        assert (ids, text) == (full_ids, full_text)
        assert last.usage.prompt_tokens == full_last.usage.prompt_tokens
        history.append(("assistant", text))
    held = client.get_session(session)
    assert held.history_turns == len(turns) and held.history_input == pb.HISTORY_INPUT_CHAT
    assert client.delete_session(session)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(
        st.tuples(st.lists(st.integers(100, 40000), min_size=1, max_size=30) | text_st, st.integers(1, 8)),
        min_size=2,
        max_size=4,
    ),
    evict=st.booleans(),
)
def test_tokens_append_is_the_held_ids_then_the_new_ones(
    client: Client, small_pool: ServerThread, turns: list[tuple[list[int] | str, int]], evict: bool
) -> None:
    session = new_session()
    held: list[int] = []
    for i, (new, max_new) in enumerate(turns):
        options = dict(max_new_tokens=max_new, ignore_eos=True, return_token_ids=True, return_prompt_token_ids=True)
        source = {"prompt": new} if isinstance(new, str) else {"token_ids": new}
        if i == 0:
            responses = list(client.generate(**source, session_id=session, **options))
        else:
            if evict:
                evict_idle_sessions(client, small_pool, session)
            responses = list(client.generate(**source, session_id=session, continue_session=True, **options))
            new_ids = new if isinstance(new, list) else client.tokenize(new)  # SmolLM2 adds no special tokens
            assert list(responses[0].prompt_token_ids) == held + new_ids
        prompt = list(responses[0].prompt_token_ids)
        ids = [t for r in responses for t in r.token_ids]
        full_ids, _, _ = run(client, build_request(token_ids=prompt, **options))
        assert ids == full_ids
        held = prompt + ids
    info = client.get_session(session)
    assert (info.history_tokens, info.history_turns) == (len(held), len(turns))
    assert info.history_input == pb.HISTORY_INPUT_TOKENS


def test_turn_two_reuses_turn_one_and_get_session_reports_both_kinds_of_state(
    client: Client, small_pool: ServerThread
) -> None:
    session = new_session()
    first = list(
        client.generate(token_ids=list(range(300, 380)), max_new_tokens=24, ignore_eos=True, session_id=session)
    )
    usage1 = first[-1].usage
    held = client.get_session(session)
    assert (held.history_turns, held.history_tokens) == (1, 104)
    assert held.cached_tokens >= 100  # the last generated token has no KV yet
    second = list(client.generate(token_ids=[7, 8, 9], max_new_tokens=4, session_id=session, continue_session=True))
    usage2 = second[-1].usage
    assert usage2.prompt_tokens == 107
    assert usage2.cached_prompt_tokens >= 0.95 * (usage1.prompt_tokens + usage1.completion_tokens)
    evict_idle_sessions(client, small_pool, session)
    third = list(client.generate(token_ids=[10], max_new_tokens=4, session_id=session, continue_session=True))
    assert third[-1].finish_reason == pb.FINISH_REASON_LENGTH and third[-1].usage.prompt_tokens == 112
    assert third[-1].usage.cached_prompt_tokens < 100, "the evicted KV was recomputed"
    assert client.delete_session(session)
    assert client.get_session(session) is None


def _error(client: Client, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str, list[str]]:
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(request))
    return _status(err.value)


def test_refusals_name_what_is_wrong(client: Client) -> None:
    unknown = new_session()
    code, message, _ = _error(client, build_request("hi", session_id=unknown, continue_session=True))
    assert (code, message) == (
        grpc.StatusCode.NOT_FOUND,
        f"session {quote_prefix(unknown)} holds no history to continue; "
        "resend the whole conversation without continue_session to start it again",
    )
    assert _error(client, build_request("hi", continue_session=True)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "session_id: must be set with continue_session",
        ["session_id"],
    )

    chat, tokens = new_session(), new_session()
    client.generate_text(messages=[("user", "hello")], max_new_tokens=2, session_id=chat)
    client.generate_text(token_ids=[5, 6, 7], max_new_tokens=2, session_id=tokens)
    for request, field in [
        (build_request("more", session_id=chat, continue_session=True), "text"),
        (build_request(token_ids=[1], session_id=chat, continue_session=True), "token_ids"),
        (build_request(messages=[("user", "x")], session_id=tokens, continue_session=True), "chat"),
        (build_request(messages=[], session_id=chat, continue_session=True), "chat.messages"),
    ]:
        code, message, fields = _error(client, request)
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [field]), message

    assert client.delete_session(chat)
    code, message, _ = _error(client, build_request(messages=[("user", "x")], session_id=chat, continue_session=True))
    assert code == grpc.StatusCode.NOT_FOUND and "deleted" in message


def test_an_empty_new_turn_is_named_and_said_to_be_empty(client: Client) -> None:
    chat, tokens = new_session(), new_session()
    client.generate_text(messages=[("user", "hello")], max_new_tokens=2, session_id=chat)
    client.generate_text(token_ids=[5, 6, 7], max_new_tokens=2, session_id=tokens)
    empty_ids = _empty_token_ids(session_id=tokens, continue_session=True)
    for request, field in [
        (build_request(messages=[], session_id=chat, continue_session=True), "chat.messages"),
        (build_request("", session_id=tokens, continue_session=True), "text"),
        (empty_ids, "token_ids.ids"),
    ]:
        assert _error(client, request) == (grpc.StatusCode.INVALID_ARGUMENT, f"{field}: must not be empty", [field])


def test_a_history_is_capped_at_the_models_context_by_default(client: Client) -> None:
    """Without --max-session-tokens a conversation may grow to the model's context (1,024 tokens here), no more."""
    session = new_session()
    client.generate_text(token_ids=[5] * 20, max_new_tokens=4, ignore_eos=True, session_id=session)
    request = build_request(token_ids=[6] * (CONTEXT_LENGTH - 10), session_id=session, continue_session=True)
    code, message, fields = _error(client, request)
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["continue_session"])
    assert f"--max-session-tokens ({CONTEXT_LENGTH})" in message


class _BosTokenizer:
    """The default tokenizer, but one that starts every encoding with BOS unless told not to (as Llama's do)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        ids: list[int] = self._inner.encode(text, add_special_tokens=False, **kwargs)
        return [BOS, *ids] if add_special_tokens else ids


def _server_with_tokenizer(tokenizer: Any) -> ServerThread:
    loaded = dataclasses.replace(tiny_model(), tokenizer=tokenizer)
    return ServerThread(AsyncEngine(loaded, EngineConfig(kv_cache_tokens=8192, cuda_graphs=False))).start()


def test_appended_text_gets_no_special_tokens_and_needs_a_tokenizer() -> None:
    """New text in the middle of a conversation is encoded without special tokens (no BOS mid-prompt); a model
    without a tokenizer refuses text in append mode as it does in a stateless call."""
    srv = _server_with_tokenizer(_BosTokenizer(smollm2_tokenizer()))
    try:
        with Client(srv.address, timeout=60) as c:
            c.generate_text("Once upon a time", max_new_tokens=3, ignore_eos=True, session_id="bos")
            held = c.get_session("bos").history_tokens
            request = build_request(" there was", session_id="bos", continue_session=True, max_new_tokens=1)
            request.response.prompt_token_ids = True
            prompt = list(next(iter(c.generate(request))).prompt_token_ids)
            new = smollm2_tokenizer().encode(" there was", add_special_tokens=False)
            assert (len(prompt), prompt[held:]) == (held + len(new), new)
    finally:
        srv.stop()
    srv = _server_with_tokenizer(None)
    try:
        with Client(srv.address, timeout=60) as c:
            c.generate_text(token_ids=[5, 6, 7], max_new_tokens=2, session_id="ids")
            for stateless in (True, False):
                request = build_request("more", session_id="ids", continue_session=not stateless)
                message = "text: the model has no tokenizer: send token_ids"
                assert _error(c, request) == (grpc.StatusCode.INVALID_ARGUMENT, message, ["text"])
            request = build_request(messages=[("user", "hi")])
            message = "chat: the model has no tokenizer: send token_ids"
            assert _error(c, request) == (grpc.StatusCode.INVALID_ARGUMENT, message, ["chat"])
            no_input = pb.GenerateRequest(session_id="ids", continue_session=True)
            assert _error(c, no_input)[::2] == (grpc.StatusCode.INVALID_ARGUMENT, ["input"])
    finally:
        srv.stop()


def test_a_second_continuing_call_is_aborted_naming_the_first(client: Client) -> None:
    session = new_session()
    client.generate_text(token_ids=[5, 6, 7], max_new_tokens=2, ignore_eos=True, session_id=session)
    long = build_request(
        token_ids=[8],
        session_id=session,
        continue_session=True,
        request_id="long-turn",
        max_new_tokens=600,
        ignore_eos=True,
    )
    started = threading.Event()
    outcome: list[object] = []

    def first() -> None:
        try:
            for response in client.generate(long):
                started.set()
                outcome.append(response)
        except grpc.RpcError as exc:  # pragma: no cover - reported by the assertion below
            outcome.append(exc)
        started.set()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(60)
        code, message, _ = _error(client, build_request(token_ids=[9], session_id=session, continue_session=True))
        assert (code, message) == (
            grpc.StatusCode.ABORTED,
            f"session {quote_prefix(session)} is being continued by request 'long-turn'; retry once it has finished",
        )
        # A stateless call with the same session id is not refused.
        assert client.generate_text(token_ids=[5, 6, 7], max_new_tokens=1, session_id=session) is not None
    finally:
        thread.join(120)
    assert isinstance(outcome[-1], pb.GenerateResponse) and outcome[-1].finish_reason == pb.FINISH_REASON_LENGTH
    # The long turn finished last: the history is its whole conversation, one coherent piece.
    held = client.get_session(session)
    assert held.history_turns == 2 and held.history_tokens == 3 + 2 + 1 + 600
    code, _, _ = _error(client, build_request(token_ids=[9] * 2000, session_id=session, continue_session=True))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    responses = list(
        client.generate(token_ids=[9], session_id=session, continue_session=True, max_new_tokens=1, ignore_eos=True)
    )
    assert responses[-1].usage.prompt_tokens == 607


def test_delete_during_a_continuing_call_leaves_no_history(client: Client, small_pool: ServerThread) -> None:
    session = new_session()
    client.generate_text(token_ids=[5, 6, 7], max_new_tokens=2, session_id=session)
    stream = client.generate(
        token_ids=[8], session_id=session, continue_session=True, max_new_tokens=400, ignore_eos=True
    )
    next(stream)
    assert client.delete_session(session)
    assert list(stream)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert wait_until(lambda: small_pool.engine.num_running == 0, timeout=30)
    held = client.get_session(session)
    assert held is None or held.history_turns == 0, "the deleted history came back"


def test_limits_end_histories_and_name_their_flags() -> None:
    """The history's limits are the edge's and the store's alone: the core on a thread."""
    history = HistoryConfig(max_sessions=2, max_tokens=60)
    srv = ServerThread(tiny_engine(in_process=True), history=history).start()
    try:
        with Client(srv.address, timeout=60) as c:
            c.generate_text(token_ids=[5] * 20, max_new_tokens=4, ignore_eos=True, session_id="a")
            code, message, fields = _error(c, build_request(token_ids=[6] * 40, session_id="a", continue_session=True))
            assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["continue_session"])
            assert "--max-session-tokens" in message
            # A turn that takes the history to the cap ends it.
            c.generate_text(
                token_ids=[6] * 30, max_new_tokens=6, ignore_eos=True, session_id="a", continue_session=True
            )
            code, message, _ = _error(c, build_request(token_ids=[1], session_id="a", continue_session=True))
            assert code == grpc.StatusCode.NOT_FOUND and "--max-session-tokens" in message
            for key in "bcd":
                c.generate_text(token_ids=[5] * 4, max_new_tokens=1, session_id=key)
            code, message, _ = _error(c, build_request(token_ids=[1], session_id="b", continue_session=True))
            assert code == grpc.StatusCode.NOT_FOUND and "--max-sessions" in message
    finally:
        srv.stop()


# -- the default model (SmolLM2-135M-Instruct), greedy ---------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[Client, ServerThread]]:
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.frontend.async_engine import AsyncEngine
    from llmserve.models.loader import load_model

    # The same 1,024-token pool as the tiny model's: the filler evicts every idle session.
    engine = AsyncEngine(load_model(), EngineConfig(kv_cache_tokens=POOL_TOKENS, max_num_seqs=4, cuda_graphs=False))
    srv = ServerThread(engine).start()
    with Client(srv.address, timeout=180) as c:
        yield c, srv
    srv.stop()


ANA = ["My name is Ana.", "What is my name? Reply with just the name."]


@pytest.mark.real_model
def test_real_model_remembers_the_name_in_append_mode(real: tuple[Client, ServerThread]) -> None:
    client, _ = real
    first = list(client.chat(ANA[0], session_id="real-ana", new=True, max_new_tokens=48))
    answer1 = "".join(r.text for r in first)
    second = list(client.chat(ANA[1], session_id="real-ana", max_new_tokens=48))
    answer2 = "".join(r.text for r in second)
    full = client.generate_text(
        messages=[("user", ANA[0]), ("assistant", answer1), ("user", ANA[1])], max_new_tokens=48
    )
    assert "Ana" in answer2 and answer2 == full, (answer2, full)
    usage1 = first[-1].usage
    assert second[-1].usage.cached_prompt_tokens >= 0.95 * (usage1.prompt_tokens + usage1.completion_tokens)


@pytest.mark.real_model
@pytest.mark.parametrize(
    "system, messages, evict_before",
    [
        (None, ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?"], 2),
        ("You are a terse assistant.", ["Name a prime number.", "Another one, larger."], 1),
    ],
)
def test_real_model_append_equals_full_resend(
    real: tuple[Client, ServerThread], system: str | None, messages: list[str], evict_before: int
) -> None:
    client, srv = real
    session = new_session()
    history = [("system", system)] if system else []
    for i, message in enumerate(messages):
        if i == evict_before:
            evict_idle_sessions(client, srv, session)
        history.append(("user", message))
        options = dict(max_new_tokens=12, return_token_ids=True)
        append = client.chat(message, session_id=session, new=i == 0, system=system if i == 0 else None, **options)
        ids = [t for r in append for t in r.token_ids]
        full_ids, text, _ = run(client, build_request(messages=history, **options))
        assert ids == full_ids, (i, message)
        history.append(("assistant", text))
