"""Error statuses: validation (real engine), admission control, and engine failures forced with a fake engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from fake_engine import FakeEngine
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from harness import CONTEXT_LENGTH, ServerThread, bad_request_fields, tiny_engine, wait_until

from llmserve_client import build_request, pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc


def _status(err: grpc.RpcError) -> tuple[grpc.StatusCode, str, list[str]]:
    """Code, message and the BadRequest field violations' fields."""
    return err.code(), err.details(), bad_request_fields(err)


def _first_error(stub, request: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Generate(request, timeout=30):
            pass
    return err.value


def _health(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


INVALID = [
    ("sampling.temperature", build_request("hi", temperature=-1.0)),
    ("sampling.top_p", build_request("hi", top_p=0.0)),
    ("sampling.top_p", build_request("hi", top_p=1.5)),
    ("sampling.top_k", build_request("hi", top_k=-1)),
    ("sampling.min_p", build_request("hi", min_p=2.0)),
    ("sampling.repetition_penalty", build_request("hi", repetition_penalty=0.0)),
    ("sampling.seed", build_request("hi", temperature=1.0, seed=-5)),
    ("stopping.max_new_tokens", build_request("hi", max_new_tokens=CONTEXT_LENGTH + 10)),
    ("stopping.max_new_tokens", build_request("hi", max_new_tokens=0)),
    ("stopping.min_new_tokens", build_request("hi", max_new_tokens=4, min_new_tokens=8)),
    ("stopping.stop_sequences", build_request("hi", stop=[""])),
    ("stopping.stop_token_ids", build_request("hi", stop_token_ids=[10**6])),
    ("response.top_logprobs", build_request("hi", top_logprobs=21)),
    ("text", build_request("")),
    ("text", build_request("hello " * (CONTEXT_LENGTH + 50))),
    ("token_ids.ids", build_request(token_ids=[5] * (CONTEXT_LENGTH + 1))),
    ("token_ids.ids", build_request(token_ids=[1, -3, 2])),
    ("token_ids.ids", build_request(token_ids=[49152])),
    ("chat.messages", build_request(messages=[])),
    ("input", pb.GenerateRequest()),
]


@pytest.mark.parametrize(("field", "request_pb"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_request_names_the_field(server: ServerThread, stub, channel, field: str, request_pb) -> None:
    code, message, fields = _status(_first_error(stub, request_pb))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith(f"{field}: ")
    assert fields == [field]
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert server.engine.num_running == 0


def _empty_token_ids(**options: object) -> pb.GenerateRequest:
    request = build_request(token_ids=[], **options)
    request.token_ids.SetInParent()  # the input chosen, with no ids in it
    return request


EMPTY = [
    ("text", build_request("")),
    ("token_ids", _empty_token_ids()),  # the engine's empty prompt, named after the input the caller set
    ("chat.messages", build_request(messages=[])),
]


@pytest.mark.parametrize(("field", "request_pb"), EMPTY, ids=[f for f, _ in EMPTY])
def test_an_empty_input_is_named_and_said_to_be_empty(stub, field: str, request_pb) -> None:
    code, message, fields = _status(_first_error(stub, request_pb))
    assert (code, message, fields) == (grpc.StatusCode.INVALID_ARGUMENT, f"{field}: must not be empty", [field])


def test_session_rpcs_need_a_session_id(stub) -> None:
    for method, request in ((stub.GetSession, pb.GetSessionRequest()), (stub.DeleteSession, pb.DeleteSessionRequest())):
        with pytest.raises(grpc.RpcError) as err:
            method(request, timeout=5)
        assert _status(err.value) == (grpc.StatusCode.INVALID_ARGUMENT, "session_id: must not be empty", ["session_id"])
    # An id that no session can have (a control character) names nothing to read or delete.
    with pytest.raises(grpc.RpcError) as err:
        stub.GetSession(pb.GetSessionRequest(session_id="a\nb"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.DeleteSession(pb.DeleteSessionRequest(session_id="a\nb"), timeout=5).deleted is False


def test_tokenize_needs_input(stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(), timeout=5)
    assert _status(err.value) == (grpc.StatusCode.INVALID_ARGUMENT, "input: set one of text, chat", ["input"])
    message = "input: set one of text, chat, token_ids"
    assert _status(_first_error(stub, pb.GenerateRequest())) == (grpc.StatusCode.INVALID_ARGUMENT, message, ["input"])


# -- admission control: the server's own limit on concurrent streams ------------------------------------------


@pytest.fixture(scope="module")
def limited() -> Iterator[ServerThread]:
    srv = ServerThread(tiny_engine(), max_concurrent_streams=2).start()
    yield srv
    srv.stop()


def test_resource_exhausted_beyond_max_concurrent_streams(limited: ServerThread) -> None:
    from llmserve.api.errors import RETRY_DELAY_S

    with grpc.insecure_channel(limited.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        long = build_request("Once upon a time", max_new_tokens=900, ignore_eos=True)
        calls = [stub.Generate(long, timeout=60) for _ in range(2)]
        for call in calls:
            next(call)  # both are in flight
        err = _first_error(stub, build_request("hi", max_new_tokens=2))
        assert (err.code(), err.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "2 Generate streams in flight, the server's limit (--max-concurrent-streams); retry later",
        )
        retry = error_details_pb2.RetryInfo()
        assert rpc_status.from_call(err).details[-1].Unpack(retry)
        assert retry.retry_delay.ToNanoseconds() == int(RETRY_DELAY_S * 1e9)
        for call in calls:
            call.cancel()
        assert wait_until(lambda: limited.server.servicer.num_streams == 0, timeout=5)
        assert list(stub.Generate(build_request("hi", max_new_tokens=2), timeout=30))[-1].finish_reason


# -- engine failures, forced with the fake engine -------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[ServerThread]:
    srv = ServerThread(FakeEngine()).start()
    yield srv
    srv.stop()


def _fake_stub(srv: ServerThread) -> tuple[grpc.Channel, generate_pb2_grpc.GenerateServiceStub]:
    channel = grpc.insecure_channel(srv.address)
    return channel, generate_pb2_grpc.GenerateServiceStub(channel)


def test_engine_queue_full_is_resource_exhausted(fake: ServerThread) -> None:
    fake.engine.queue_full = True
    channel, stub = _fake_stub(fake)
    with channel:
        assert _first_error(stub, build_request("hi")).code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_dead_engine_is_unavailable_and_not_serving(fake: ServerThread) -> None:
    fake.engine.dead_reason = "the GPU fell off the bus"
    channel, stub = _fake_stub(fake)
    with channel:
        err = _first_error(stub, build_request("hi"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "GPU fell off" in err.details()
        assert wait_until(lambda: _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)


def test_failed_generation_sends_what_it_has_then_internal(fake: ServerThread) -> None:
    fake.engine.fail_after = 3
    channel, stub = _fake_stub(fake)
    with channel:
        received = []
        with pytest.raises(grpc.RpcError) as err:
            for response in stub.Generate(build_request("hi", max_new_tokens=10), timeout=10):
                received.append(response)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "fake forward failed" in err.value.details()
        assert "".join(r.text for r in received)
        assert received[-1].finish_reason == pb.FINISH_REASON_ERROR


def test_duplicate_request_id_in_flight_is_already_exists(fake: ServerThread) -> None:
    channel, stub = _fake_stub(fake)
    with channel:
        first = stub.Generate(build_request("hi", max_new_tokens=200, request_id="same"), timeout=10)
        next(first)
        err = _first_error(stub, build_request("hi", request_id="same"))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        first.cancel()


def test_unavailable_while_the_model_loads() -> None:
    srv = ServerThread(FakeEngine()).start(serve=False)
    try:
        channel, stub = _fake_stub(srv)
        with channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert _health(channel, "llmserve.v1.GenerateService") == health_pb2.HealthCheckResponse.NOT_SERVING
            err = _first_error(stub, build_request("hi"))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in err.details()
            srv.serve()
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            assert list(stub.Generate(build_request("hi", max_new_tokens=2), timeout=10))
    finally:
        srv.stop()


def _draining(channel: grpc.Channel) -> bool:
    """Health says NOT_SERVING, or the server already refuses new calls (its listener closes as it drains)."""
    try:
        return _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE


def test_drain_finishes_in_flight_streams_and_refuses_new_ones(fake: ServerThread) -> None:
    channel, stub = _fake_stub(fake)
    with channel:
        call = stub.Generate(build_request("hi", max_new_tokens=100), timeout=30)  # ~0.5 s of fake steps
        next(call)
        stopping = threading.Thread(target=fake.run, args=(fake.server.stop(10.0),))
        stopping.start()
        assert wait_until(lambda: _draining(channel), timeout=5)
        assert _first_error(stub, build_request("hi")).code() == grpc.StatusCode.UNAVAILABLE
        rest = list(call)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        stopping.join(timeout=10)
        assert not stopping.is_alive()
    fake.server = None  # already stopped


def test_drain_waits_for_the_last_stream_and_no_longer(fake: ServerThread) -> None:
    """With two streams in flight, the drain lets the longer one finish after the shorter ends, and returns as
    soon as it has (well inside its 60 s grace)."""
    channel, stub = _fake_stub(fake)
    with channel:
        short = stub.Generate(build_request("hi", max_new_tokens=10), timeout=60)
        long = stub.Generate(build_request("hi", max_new_tokens=200), timeout=60)  # ~1 s of fake steps
        next(short), next(long)
        started = time.monotonic()
        stopping = threading.Thread(target=fake.run, args=(fake.server.stop(60.0),))
        stopping.start()
        assert list(short)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        rest = list(long)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 200
        stopping.join(timeout=30)
        assert not stopping.is_alive() and time.monotonic() - started < 30
    fake.server = None  # already stopped


def test_a_draining_servicer_refuses_new_streams_while_the_listener_is_open(fake: ServerThread) -> None:
    """Drain begins in the servicer before the listener closes: a call that still gets through is refused by the
    servicer itself (UNAVAILABLE, saying why), while the stream already in flight finishes."""
    channel, stub = _fake_stub(fake)
    with channel:
        call = stub.Generate(build_request("hi", max_new_tokens=20), timeout=30)
        next(call)
        fake.server.servicer.begin_drain()
        err = _first_error(stub, build_request("hi"))
        assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        assert list(call)[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_drain_cancels_streams_past_the_grace_period(fake: ServerThread) -> None:
    fake.engine.step_s = 0.05
    channel, stub = _fake_stub(fake)
    with channel:
        call = stub.Generate(build_request("hi", max_new_tokens=200), timeout=30)  # ~10 s of fake steps
        next(call)
        fake.run(fake.server.stop(0.3))
        with pytest.raises(grpc.RpcError):
            list(call)
        assert fake.engine.num_running == 0
    fake.server = None


def test_a_cancelled_calls_request_id_is_reusable_at_once(server: ServerThread) -> None:
    """Cancel a stream and reuse its id right away, as a retrying client does: the new call is served. (The
    asyncio client sends the new call right behind the cancellation; about 1 in 100 got ALREADY_EXISTS.)"""

    async def calls() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            for i in range(100):
                long = build_request("hi", max_new_tokens=400, ignore_eos=True, request_id="again")
                call = stub.Generate(long, timeout=30)
                await call.read()
                call.cancel()
                again = stub.Generate(build_request("hi", max_new_tokens=2, request_id="again"), timeout=30)
                responses = [response async for response in again]
                assert responses[-1].request_id == "again" and responses[-1].usage.completion_tokens >= 1, i

    asyncio.run(calls())


def test_a_request_id_in_flight_waits_for_its_stream_to_end_before_it_is_a_duplicate() -> None:
    """The admission itself: an id whose stream ends within the wait is admitted; one that stays is not."""
    from llmserve.api.admission import REUSE_WAIT_S
    from llmserve.api.errors import ServiceError
    from llmserve.api.servicer import GenerateServicer
    from llmserve.config import ServerConfig

    async def body() -> None:
        servicer = GenerateServicer(ServerConfig())
        servicer.attach(FakeEngine())
        admission = servicer.admission
        first = await admission.admit(None, "x")
        ended = admission.ended(first)
        asyncio.get_running_loop().call_later(0.05, admission.release, first)  # the cancelled stream's handler ends
        second = await admission.admit(None, "x")
        assert ended.is_set() and admission.ended(second) is not ended
        started = time.monotonic()
        with pytest.raises(ServiceError) as err:
            await admission.admit(None, "x")  # the second stream goes on
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert time.monotonic() - started >= REUSE_WAIT_S * 0.9

    asyncio.run(body())


def test_errors_map_to_statuses_with_their_details() -> None:
    """The edge's error conversions on their own: the field path and reason a caller sees, and the retry delay."""
    from google.rpc import code_pb2

    from llmserve.api.errors import RETRY_DELAY_S, ServiceError, code_name, status_for
    from llmserve.engine.frontend.errors import InvalidRequest, QueueFull

    status = status_for(InvalidRequest("sampling.top_p", "must be in (0, 1]"))
    assert status.code == code_pb2.INVALID_ARGUMENT
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [("sampling.top_p", "must be in (0, 1]")]
    for exc, delay_ns in (
        (QueueFull("busy"), int(RETRY_DELAY_S * 1e9)),
        (ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=2.5), 2_500_000_000),
    ):
        status = status_for(exc)
        retry = error_details_pb2.RetryInfo()
        assert status.code == code_pb2.RESOURCE_EXHAUSTED and status.details[-1].Unpack(retry)
        assert retry.retry_delay.ToNanoseconds() == delay_ns
    assert status_for(ServiceError(grpc.StatusCode.NOT_FOUND, "no session")).details == []
    assert status_for(QueueFull("128 requests waiting")).message == "engine queue is full: 128 requests waiting"
    assert str(ServiceError(grpc.StatusCode.NOT_FOUND, "no session")) == "no session"
    # The code a call's record names: the status's, or an unmapped fault's type.
    assert (code_name(QueueFull("busy")), code_name(InvalidRequest("text", "x")), code_name(KeyError())) == (
        "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "KeyError",
    )  # fmt: skip


def test_call_observers_are_told_the_code_the_finish_and_the_metadata(caplog: pytest.LogCaptureFixture) -> None:
    """What metrics and tracing read about each ended call: unmapped failures are UNKNOWN, a cancel or deadline that
    reached the engine without a finish reason reads as one, and an observer's exception reaches no one else. The
    request log line is made from the same closed record: it says the same finish."""
    from types import SimpleNamespace

    from llmserve.api.servicer import GenerateServicer
    from llmserve.config import ServerConfig
    from llmserve.telemetry.call import CallRecord

    seen: list = []

    class Broken:
        def call_finished(self, call: object) -> None:
            raise RuntimeError("observer bug")

    class Recorder:
        def call_finished(self, call: object) -> None:
            seen.append(call)

    servicer = GenerateServicer(ServerConfig(), observers=[Broken(), Recorder()])
    context = SimpleNamespace(invocation_metadata=lambda: (("x-session-id", "s"),))
    cases = [
        (CallRecord("a", 1.0, status="ValueError", queued=2.0), "UNKNOWN", None),
        (CallRecord("b", 1.0, status="CANCELLED", queued=2.0), "CANCELLED", "cancelled"),
        (CallRecord("c", 1.0, status="DEADLINE_EXCEEDED", queued=2.0), "DEADLINE_EXCEEDED", "deadline"),
        (CallRecord("d", 1.0, status="CANCELLED"), "CANCELLED", None),  # refused before the engine took it
        (CallRecord("e", 1.0, status="OK", queued=2.0, finish_reason="length"), "OK", "length"),
    ]
    with caplog.at_level("INFO", logger="llmserve.requests"):
        for record, _, _ in cases:
            servicer._record_end(record, True, context)
    assert [(call.code, call.finish_reason) for call in seen] == [(code, finish) for _, code, finish in cases]
    logged = [r.getMessage() for r in caplog.records if r.name == "llmserve.requests" and r.levelname == "INFO"]
    assert [f"finish={finish or '-'}" in line for line, (_, _, finish) in zip(logged, cases, strict=True)] == [True] * 5
    assert "status=ValueError" in logged[0]  # the log names an unmapped fault by its type
    call = seen[-1]
    assert call.has_session is True and call.metadata == (("x-session-id", "s"),) and call.start_ns > 0
    servicer._record_end(CallRecord("f", 1.0, status="OK"), False, SimpleNamespace(invocation_metadata=lambda: None))
    assert seen[-1].has_session is False and seen[-1].metadata == ()


def test_a_stalled_stream_and_a_model_window_are_reported(fake: ServerThread) -> None:
    from llmserve.api.errors import StreamStalled

    stalled = StreamStalled(2.5)
    assert stalled.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stalled.message == "the stream was aborted: the client read nothing for 2.5 s (--stream-stall-timeout)"
    info = fake.engine.model_info
    before, info.sliding_window = info.sliding_window, 128
    channel, stub = _fake_stub(fake)
    try:
        with channel:
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).sliding_window == 128
    finally:
        info.sliding_window = before


def test_chat_input_without_a_chat_template_is_named() -> None:
    """A model without a chat template (or a tokenizer object without the attribute) refuses chat input, naming it
    and saying what to send instead; an empty conversation is refused before the template is asked."""
    from types import SimpleNamespace

    from llmserve.api.prompts import chat_token_ids as _chat_token_ids
    from llmserve.engine.frontend.errors import InvalidRequest

    messages = [pb.ChatMessage(role="user", content="hi")]
    for tokenizer in (SimpleNamespace(chat_template=None), SimpleNamespace()):
        with pytest.raises(InvalidRequest) as err:
            _chat_token_ids(tokenizer, messages)
        assert (err.value.field, err.value.reason) == ("chat", "the model has no chat template: send text or token_ids")
    with pytest.raises(InvalidRequest) as err:
        _chat_token_ids(SimpleNamespace(), [])
    assert (err.value.field, err.value.reason) == ("chat.messages", "must not be empty")


def test_a_chat_template_renders_the_ids_without_extra_special_tokens() -> None:
    """The template writes the special tokens it wants: its text is encoded without more (a tokenizer that would add a
    BOS by default adds none); a template that rejects the conversation is INVALID_ARGUMENT on chat.messages, its
    message clipped."""
    from llmserve.api.prompts import chat_token_ids as _chat_token_ids
    from llmserve.engine.frontend.errors import InvalidRequest

    class Tokenizer:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, turns, tokenize=True, add_generation_prompt=False):
            if any(turn["role"] == "bot" for turn in turns):
                raise ValueError("roles must alternate user/assistant: " + "x" * 1000)
            assert add_generation_prompt
            return "".join(f"<{turn['role']}>{turn['content']}" for turn in turns) + "<assistant>"

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    ids = _chat_token_ids(Tokenizer(), [pb.ChatMessage(role="user", content="hi")])
    assert ids == [ord(c) for c in "<user>hi<assistant>"]
    with pytest.raises(InvalidRequest) as err:
        _chat_token_ids(Tokenizer(), [pb.ChatMessage(role="bot", content="hi")])
    assert err.value.field == "chat.messages"
    assert err.value.reason.startswith("the chat template rejects it: roles must alternate user/assistant: xxx")
    assert len(err.value.reason) == len("the chat template rejects it: ") + 200 + len("...")


def test_a_request_converts_to_the_engines_with_its_defaults() -> None:
    """Every sampling and stopping field reaches the engine as sent; unset ones take their documented defaults, and
    an unset max_new_tokens is the least of the server's default, the model's limit and the room left (at least 1)."""
    from types import SimpleNamespace

    from llmserve.api.servicer import DEADLINE_MARGIN_S, GenerateServicer
    from llmserve.config import ServerConfig
    from llmserve.engine.frontend.protocol import ModelInfo
    from llmserve.engine.frontend.request import SamplingParams, StoppingParams

    engine = SimpleNamespace(model_info=ModelInfo("m", 1000, 300, "float32", "cpu", 256))
    servicer = GenerateServicer(ServerConfig(default_max_new_tokens=200))

    def convert(request: pb.GenerateRequest, prompt_len: int = 10, deadline: float | None = None, identity=None):
        return servicer._engine_request(engine, request, "r", [1] * prompt_len, None, deadline, identity)

    plain = convert(pb.GenerateRequest(text="hi"))
    assert plain.sampling == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    assert plain.stopping == StoppingParams(max_new_tokens=200)
    assert (plain.deadline, plain.priority, plain.logprobs, plain.top_logprobs, plain.cache_salt) == (
        None, 0, False, 0, None,
    )  # fmt: skip
    # The engine's deadline is the call's, a margin early, so that the last message reaches the caller in time.
    assert convert(pb.GenerateRequest(text="hi"), deadline=100.0).deadline == 100.0 - DEADLINE_MARGIN_S
    assert convert(pb.GenerateRequest(text="hi", priority=-3)).priority == -3
    for options, expected in (({"top_logprobs": 1}, (True, 1)), ({"logprobs": True}, (True, 0))):
        converted = convert(pb.GenerateRequest(text="hi", response=pb.ResponseOptions(**options)))
        assert (converted.logprobs, converted.top_logprobs) == expected
    # With authentication, the prefix cache is salted with the caller's identity unless it is shared.
    assert convert(pb.GenerateRequest(text="hi"), identity="alice").cache_salt == "alice"
    shared = GenerateServicer(ServerConfig(shared_prefix_cache=True))
    assert shared._engine_request(engine, pb.GenerateRequest(text="hi"), "r", [1], None, None, "a").cache_salt is None
    assert convert(pb.GenerateRequest(text="hi"), prompt_len=950).stopping.max_new_tokens == 50  # the room left
    assert convert(pb.GenerateRequest(text="hi"), prompt_len=1000).stopping.max_new_tokens == 1
    servicer = GenerateServicer(ServerConfig(default_max_new_tokens=500))
    assert convert(pb.GenerateRequest(text="hi")).stopping.max_new_tokens == 300  # the model's limit

    request = build_request(
        "hi", temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=11,
        max_new_tokens=7, min_new_tokens=2, stop=["\n"], stop_token_ids=[3, 4], ignore_eos=True,
    )  # fmt: skip
    request.stopping.include_stop_sequence = True
    full = convert(request)
    assert full.sampling == SamplingParams(
        temperature=pytest.approx(0.7), top_k=5, top_p=pytest.approx(0.9), min_p=pytest.approx(0.05),
        repetition_penalty=pytest.approx(1.3), seed=11,
    )  # fmt: skip
    assert full.stopping == StoppingParams(
        max_new_tokens=7, min_new_tokens=2, stop_sequences=("\n",), stop_token_ids=(3, 4),
        include_stop_sequence=True, ignore_eos=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("reason", "code", "message"),
    [
        ("DEADLINE", grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"),
        ("CANCELLED", grpc.StatusCode.UNAVAILABLE, "the server cancelled the request (shutdown)"),
        ("ERROR", grpc.StatusCode.INTERNAL, "generation failed: boom"),
    ],
)
def test_endings_that_are_not_a_finish_end_the_stream_with_their_status(reason: str, code, message: str) -> None:
    """The last message is sent first (with its finish reason), then the call ends with the ending's status."""
    from llmserve.api.errors import ServiceError
    from llmserve.api.servicer import GenerateServicer
    from llmserve.config import ServerConfig
    from llmserve.engine.frontend.outputs import Delta, FinishReason, Usage
    from llmserve.engine.frontend.request import GenerationRequest, StoppingParams
    from llmserve.telemetry.call import CallRecord

    class OneDelta:
        async def generate(self, request: GenerationRequest):
            yield Delta(request.request_id, [5], finish_reason=FinishReason[reason], usage=Usage(3, 0, 1), error="boom")

    async def stream() -> list[pb.GenerateResponse]:
        servicer = GenerateServicer(ServerConfig())
        gen = GenerationRequest("r", (1, 2, 3), stopping=StoppingParams(max_new_tokens=4))
        return [r async for r in servicer._stream(OneDelta(), gen, CallRecord("r", 0.0))]

    with pytest.raises(ServiceError) as err:
        asyncio.run(stream())
    assert (err.value.code, err.value.message) == (code, message)


def test_before_the_engine_is_attached_every_call_is_unavailable_saying_so() -> None:
    from llmserve.api.errors import ServiceError
    from llmserve.api.servicer import GenerateServicer
    from llmserve.config import ServerConfig

    with pytest.raises(ServiceError) as err:
        GenerateServicer(ServerConfig()).ready_engine()
    assert (err.value.code, err.value.message) == (grpc.StatusCode.UNAVAILABLE, "the model is still loading")


def test_attaching_an_engine_caps_histories_at_its_context_unless_configured() -> None:
    """A servicer of its own (mutation testing maps a module fixture's start-up to that module's first test only)."""
    from llmserve.api.servicer import GenerateServicer
    from llmserve.config import ServerConfig
    from llmserve.engine.frontend.errors import InvalidRequest
    from llmserve.history import HistoryConfig

    servicer = GenerateServicer(ServerConfig())
    servicer.attach(FakeEngine())
    servicer.prompts.check_length(256)  # the fake model's context
    with pytest.raises(InvalidRequest, match=r"--max-session-tokens \(256\)"):
        servicer.prompts.check_length(257)
    configured = GenerateServicer(ServerConfig(history=HistoryConfig(max_tokens=100)))
    configured.attach(FakeEngine())
    with pytest.raises(InvalidRequest, match=r"--max-session-tokens \(100\)"):
        configured.prompts.check_length(101)


def test_the_per_identity_stream_cap_counts_streams_as_they_end() -> None:
    """--max-streams-per-identity (here without authentication: every caller is one identity): a stream that ends
    frees its place, and only its own."""
    engine = FakeEngine()
    engine.step_s = 0.05  # a 250-token stream lasts ~12 s unless cancelled
    srv = ServerThread(engine, max_streams_per_identity=2).start()
    try:
        channel, stub = _fake_stub(srv)
        with channel:
            servicer = srv.server.servicer

            def hold() -> grpc.Call:
                call = stub.Generate(build_request("hi", max_new_tokens=250), timeout=60)
                next(call)
                return call

            def refused() -> bool:
                return _first_error(stub, build_request("hi")).code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            first, second = hold(), hold()
            assert refused()
            first.cancel()
            assert wait_until(lambda: servicer.num_streams == 1, timeout=10)
            third = hold()  # the place the first one left
            assert refused(), "the second is still in flight"
            for call in (second, third):
                call.cancel()
            assert wait_until(lambda: servicer.num_streams == 0, timeout=10)
            again = [hold(), hold()]  # both places free again
            for call in again:
                call.cancel()
    finally:
        srv.stop()
