"""api/interceptor.py on a real grpc.aio server on a loopback port, in front of a GenerateService whose handlers
raise what each test needs: a known error becomes its status with google.rpc details (also after a stream's first
messages), an unknown one stays UNKNOWN, undecodable bytes are INVALID_ARGUMENT naming `request`, a stream whose
client reads nothing is aborted once a message has waited `stall_timeout_s`, every call of the services it wraps ends
with the replica's trailing metadata, and other services pass through untouched. The same through the whole server:
tests/service/test_input_limits.py (undecodable), test_robustness.py (a stalled reader), test_request_log.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from llmserve.api.errors import RETRY_DELAY_S, StreamStalled
from llmserve.api.interceptor import ErrorInterceptor
from llmserve.engine.types.errors import InvalidRequest, QueueFull
from llmserve_client import pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

REPLICA = ("x-llmserve-replica", "replica-1")
STALL_S = 0.5
BIG = "x" * (1 << 20)  # a message the client's flow control holds back once a few are unread


class Servicer(generate_pb2_grpc.GenerateServiceServicer):
    """Each request_id says what the handler does; `stalled` records a StreamStalled thrown into the stream."""

    def __init__(self) -> None:
        self.stalled: list[StreamStalled] = []

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        if request.text == "invalid":
            raise InvalidRequest("text", "is not what the test wants")
        if request.text == "bug":
            raise KeyError("a bug")
        return pb.TokenizeResponse(token_ids=[1, 2])

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if request.request_id == "big":
            try:
                for _ in range(64):
                    yield pb.GenerateResponse(request_id="big", text=BIG)
            except StreamStalled as exc:
                self.stalled.append(exc)
                raise
            return
        yield pb.GenerateResponse(request_id=request.request_id, text="first")
        if request.request_id == "full":
            raise QueueFull("128 requests waiting")
        if request.request_id == "bug":
            raise KeyError("a bug")


async def serve(servicer: Servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor(STALL_S, lambda: (REPLICA,))])
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


Body = Callable[[grpc.aio.Channel, Servicer], object]


def with_server(body: Callable[[grpc.aio.Channel, Servicer], object]) -> None:
    async def run() -> None:
        servicer = Servicer()
        server, address = await serve(servicer)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await body(channel, servicer)  # type: ignore[misc]
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_a_known_error_is_its_status_with_details_and_the_replica_is_named() -> None:
    async def body(channel: grpc.aio.Channel, _: Servicer) -> None:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        call = stub.Tokenize(pb.TokenizeRequest(text="fine"))
        assert list((await call).token_ids) == [1, 2]
        assert REPLICA in tuple(await call.trailing_metadata())  # on success too
        call = stub.Tokenize(pb.TokenizeRequest(text="invalid"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "text: is not what the test wants"
        status = rpc_status.from_call(err.value)
        bad = error_details_pb2.BadRequest()
        assert status is not None and status.details[0].Unpack(bad)
        assert [(v.field, v.description) for v in bad.field_violations] == [("text", "is not what the test wants")]
        assert REPLICA in tuple(err.value.trailing_metadata())

    with_server(body)


def test_a_stream_sends_what_it_had_then_ends_with_the_errors_status() -> None:
    async def body(channel: grpc.aio.Channel, _: Servicer) -> None:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for response in stub.Generate(pb.GenerateRequest(request_id="full", text="hi")):
                received.append(response.text)
        assert received == ["first"]
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(err.value)
        retry = error_details_pb2.RetryInfo()
        assert status is not None and status.details[-1].Unpack(retry)
        assert retry.retry_delay.ToNanoseconds() == int(RETRY_DELAY_S * 1e9)
        assert REPLICA in tuple(err.value.trailing_metadata())
        ok = stub.Generate(pb.GenerateRequest(request_id="ok", text="hi"))
        assert [r.text async for r in ok] == ["first"]
        assert await ok.code() == grpc.StatusCode.OK and REPLICA in tuple(await ok.trailing_metadata())

    with_server(body)


def test_an_unknown_error_is_left_to_grpc() -> None:
    async def body(channel: grpc.aio.Channel, _: Servicer) -> None:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for call in (
            stub.Tokenize(pb.TokenizeRequest(text="bug")),
            stub.Generate(pb.GenerateRequest(request_id="bug", text="hi")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call if isinstance(call, grpc.aio.UnaryUnaryCall) else [r async for r in call]
            assert err.value.code() == grpc.StatusCode.UNKNOWN

    with_server(body)


def test_undecodable_bytes_are_invalid_argument_naming_the_request() -> None:
    async def body(channel: grpc.aio.Channel, _: Servicer) -> None:
        garbage = b"\xff\xff\xff\xff"
        raw_stream = channel.unary_stream("/llmserve.v1.GenerateService/Generate")
        raw_unary = channel.unary_unary("/llmserve.v1.GenerateService/Tokenize")
        for call, message in (
            (raw_stream(garbage), "llmserve.v1.GenerateRequest"),
            (raw_unary(garbage), "llmserve.v1.TokenizeRequest"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call if isinstance(call, grpc.aio.UnaryUnaryCall) else [r async for r in call]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == f"request: is not a valid {message} message"
            assert REPLICA in tuple(err.value.trailing_metadata())

    with_server(body)


def test_a_stream_its_client_does_not_read_is_aborted_after_the_stall_timeout() -> None:
    async def body(channel: grpc.aio.Channel, servicer: Servicer) -> None:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(request_id="big", text="hi"))
        for _ in range(200):  # the client reads nothing meanwhile
            if servicer.stalled:
                break
            await asyncio.sleep(0.05)
        assert [exc.code for exc in servicer.stalled] == [grpc.StatusCode.RESOURCE_EXHAUSTED]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--stream-stall-timeout" in (err.value.details() or "")

    with_server(body)


def test_other_services_pass_through_untouched() -> None:
    async def body(channel: grpc.aio.Channel, _: Servicer) -> None:
        call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert (await call).status == health_pb2.HealthCheckResponse.SERVING
        assert REPLICA not in tuple(await call.trailing_metadata() or ())

    with_server(body)
