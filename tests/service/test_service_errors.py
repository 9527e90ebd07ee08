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


def test_rerank_on_a_generating_model_is_failed_precondition(stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Rerank(pb.RerankRequest(query="q", documents=["d"]), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "serves no Rerank" in err.value.details()


def test_tokenize_needs_input(stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(), timeout=5)
    assert _status(err.value) == (grpc.StatusCode.INVALID_ARGUMENT, "input: set one of text, chat", ["input"])
    message = "input: set one of text, chat, token_ids"
    assert _status(_first_error(stub, pb.GenerateRequest())) == (grpc.StatusCode.INVALID_ARGUMENT, message, ["input"])


# -- admission control: the server's own limit on concurrent streams ------------------------------------------


@pytest.fixture(scope="module")
def limited() -> Iterator[ServerThread]:
    """The stream cap is the edge's alone: the core on a thread (a tenth of an engine process's start-up)."""
    srv = ServerThread(tiny_engine(in_process=True), max_concurrent_streams=2).start()
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


def test_a_model_window_is_reported(fake: ServerThread) -> None:
    """The model's attention window reaches GetModelInfo (StreamStalled's own status: tests/api/test_errors.py)."""
    info = fake.engine.model_info
    before, info.sliding_window = info.sliding_window, 128
    channel, stub = _fake_stub(fake)
    try:
        with channel:
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).sliding_window == 128
    finally:
        info.sliding_window = before


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
