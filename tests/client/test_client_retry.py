"""The client's routing metadata and retries, against a scripted gRPC server (refusals on demand) and the real one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from harness import ServerThread

from llmserve_client import NO_RETRY, AsyncClient, CallInfo, Client, Retry, pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

FAST = Retry(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


class Scripted(generate_pb2_grpc.GenerateServiceServicer):
    """Refuses the first `refusals` calls of each method with UNAVAILABLE; with `fail_mid_stream`, a Generate
    sends one message and then fails with UNAVAILABLE. Records every call's metadata."""

    def __init__(self) -> None:
        self.refusals = 0
        self.fail_mid_stream = False
        self.calls: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()

    def _arrive(self, method: str, context: grpc.ServicerContext) -> None:
        context.set_trailing_metadata((("x-llmserve-replica", "scripted-1"),))
        with self._lock:
            self.calls.append((method, dict(context.invocation_metadata())))
            refuse = sum(1 for m, _ in self.calls if m == method) <= self.refusals
        if refuse:
            context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        self._arrive("Generate", context)
        yield pb.GenerateResponse(text="a")
        if self.fail_mid_stream:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server cancelled the request (shutdown)")
        yield pb.GenerateResponse(text="b", finish_reason=pb.FINISH_REASON_LENGTH)

    def GetSession(self, request: pb.GetSessionRequest, context: grpc.ServicerContext) -> pb.GetSessionResponse:
        self._arrive("GetSession", context)
        return pb.GetSessionResponse(session_id=request.session_id, cached_tokens=7)

    def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.ServicerContext
    ) -> pb.DeleteSessionResponse:
        self._arrive("DeleteSession", context)
        return pb.DeleteSessionResponse(deleted=True)


@pytest.fixture
def scripted() -> Iterator[tuple[Scripted, str]]:
    servicer = Scripted()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_a_refused_start_is_retried_and_the_session_rides_in_metadata(scripted: tuple[Scripted, str]) -> None:
    servicer, address = scripted
    servicer.refusals = 2
    info = CallInfo()
    with Client(address, timeout=10, retry=FAST) as client:
        text = "".join(r.text for r in client.generate("hi", session_id="conv-7", info=info))
    assert text == "ab"
    assert (info.attempts, info.replica) == (3, "scripted-1")
    assert [m["x-session-id"] for _, m in servicer.calls] == ["conv-7"] * 3


def test_retries_stop_at_the_policys_attempts(scripted: tuple[Scripted, str]) -> None:
    servicer, address = scripted
    servicer.refusals = 5
    info = CallInfo()
    with Client(address, timeout=10, retry=FAST) as client, pytest.raises(grpc.RpcError) as err:
        list(client.generate("hi", info=info))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.attempts == 3 and len(servicer.calls) == 3
    assert all("x-session-id" not in m for _, m in servicer.calls), "no session, no routing key"
    servicer.calls.clear()
    with Client(address, timeout=10, retry=NO_RETRY) as client, pytest.raises(grpc.RpcError):
        list(client.generate("hi"))
    assert len(servicer.calls) == 1


def test_a_stream_that_fails_after_its_first_message_is_not_retried(scripted: tuple[Scripted, str]) -> None:
    servicer, address = scripted
    servicer.fail_mid_stream = True
    received = []
    with Client(address, timeout=10, retry=FAST) as client, pytest.raises(grpc.RpcError) as err:
        for response in client.generate("hi"):
            received.append(response.text)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert received == ["a"] and len(servicer.calls) == 1


def test_session_calls_carry_the_session_and_only_reads_are_retried(scripted: tuple[Scripted, str]) -> None:
    servicer, address = scripted
    servicer.refusals = 1
    with Client(address, timeout=10, retry=FAST) as client:
        assert client.get_session("conv-9").cached_tokens == 7
        with pytest.raises(grpc.RpcError):
            client.delete_session("conv-9")  # not idempotent in what it answers: never retried
    assert [(name, m["x-session-id"]) for name, m in servicer.calls] == [
        ("GetSession", "conv-9"),
        ("GetSession", "conv-9"),
        ("DeleteSession", "conv-9"),
    ]


def test_the_async_client_retries_the_same_way(scripted: tuple[Scripted, str]) -> None:
    servicer, address = scripted
    servicer.refusals = 1

    async def run() -> tuple[str, CallInfo]:
        info = CallInfo()
        async with AsyncClient(address, timeout=10, retry=FAST) as client:
            text = "".join([r.text async for r in client.generate("hi", session_id="conv-a", info=info)])
            assert (await client.get_session("conv-a")).cached_tokens == 7
        return text, info

    text, info = asyncio.run(run())
    assert text == "ab" and (info.attempts, info.replica) == (2, "scripted-1")
    assert [m.get("x-session-id") for _, m in servicer.calls] == ["conv-a"] * 4  # each refused once


def test_the_cli_reports_the_replica(server: ServerThread) -> None:
    cmd = [sys.executable, "-m", "llmserve_client", "--address", server.address, "--timeout", "60"]
    cmd += ["generate", "Hello", "--max-new-tokens", "2", "--session", "cli-1", "--stats"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert f"replica={server.server.replica} attempts=1" in out.stderr
