"""Every input bounded: each limit answered INVALID_ARGUMENT naming the field and the limit, before any
tokenizer work; short quotes of caller input in messages; undecodable and oversized messages; RetryInfo."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterator

import grpc
import psutil
import pytest
from fake_engine import FakeEngine, FakeTokenizer
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from harness import CONTEXT_LENGTH, ServerThread, bad_request_fields

from llmserve_client import Client, build_request, pb

# What this module tests is the edge's (the size limits, checked before the engine): the shared server's core runs
# on a thread.
ENGINE_IN_PROCESS = True

MAX_PROMPT_BYTES = 16 * CONTEXT_LENGTH  # the default: 16 bytes per token of context


def _chat(n: int, role: str = "user", content: str = "hi") -> pb.GenerateRequest:
    return build_request(messages=[{"role": role, "content": content}] * n, max_new_tokens=2)


LIMITS = [
    ("request_id", "--max-request-id-length", build_request("hi", request_id="x" * 129)),
    ("request_id", "printable", build_request("hi", request_id="abc\nrequest_id=forged status=OK")),
    ("request_id", "printable", build_request("hi", request_id="nul\x00")),
    ("session_id", "--max-session-id-length", build_request("hi", session_id="s" * 129)),
    ("session_id", "printable", build_request("hi", session_id="tab\there")),
    ("stopping.stop_sequences", "--max-stop-sequences", build_request("hi", stop=[f"s{i}" for i in range(17)])),
    ("stopping.stop_sequences", "--max-stop-sequences-chars", build_request("hi", stop=["a" * 600, "b" * 600])),
    ("stopping.stop_token_ids", "--max-stop-token-ids", build_request("hi", stop_token_ids=list(range(65)))),
    ("chat.messages", "--max-chat-messages", _chat(513)),
    ("chat.messages[0].role", "--chat-roles", _chat(1, role="root")),
    ("chat.messages", "--max-prompt-bytes", _chat(2, content="x" * (MAX_PROMPT_BYTES // 2 + 1))),
    ("text", "--max-prompt-bytes", build_request("x" * (MAX_PROMPT_BYTES + 1))),
    # Bytes, not characters: 2-byte characters, half as many as the limit in bytes, plus one.
    ("text", "--max-prompt-bytes", build_request("é" * (MAX_PROMPT_BYTES // 2 + 1))),
    ("response.top_logprobs", "--max-top-logprobs", build_request("hi", top_logprobs=21)),
    ("token_ids.ids", "[0, 49152)", build_request(token_ids=[5, 2**31 - 1])),
]


@pytest.mark.parametrize(("field", "limit", "request_pb"), LIMITS, ids=[f"{f}-{i}" for i, (f, *_) in enumerate(LIMITS)])
def test_each_limit_names_the_field_and_the_limit(
    server: ServerThread, stub, field: str, limit: str, request_pb: pb.GenerateRequest
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_pb, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = err.value.details()
    assert message.startswith(f"{field}: ") and limit in message, message
    assert bad_request_fields(err.value) == [field]
    assert len(message) < 200, "no caller input beyond a short prefix"
    assert "xxxxxxxxxx" not in message and "forged" not in message
    assert server.engine.num_running == 0


def test_limits_within_bounds_are_accepted(stub) -> None:
    request = build_request(
        "x" * 100, request_id="r" * 128, session_id="s" * 128, stop=[f"s{i}" for i in range(16)],
        stop_token_ids=list(range(64)), top_logprobs=20, max_new_tokens=2,
    )  # fmt: skip
    responses = list(stub.Generate(request, timeout=30))
    assert responses[-1].request_id == "r" * 128 and responses[-1].finish_reason


def test_tokenize_is_bounded_too(stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(text="x" * (MAX_PROMPT_BYTES + 1)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_request_fields(err.value) == ["text"]


def test_a_long_unknown_session_id_is_not_found_with_a_short_message(stub) -> None:
    huge = "s" * 7000
    with pytest.raises(grpc.RpcError) as err:
        stub.GetSession(pb.GetSessionRequest(session_id=huge), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(err.value.details()) < 100
    assert stub.DeleteSession(pb.DeleteSessionRequest(session_id=huge), timeout=10).deleted is False


# -- before the tokenizer: no work, no memory ------------------------------------------------------------------


class _CountingTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return super().encode(text, add_special_tokens)


@pytest.fixture
def fake() -> Iterator[ServerThread]:
    srv = ServerThread(FakeEngine()).start()
    yield srv
    srv.stop()


def test_oversized_prompts_cost_no_tokenizer_work(fake: ServerThread) -> None:
    tokenizer = fake.engine.tokenizer = _CountingTokenizer()
    limit = 16 * fake.engine.model_info.context_length
    with Client(fake.address, timeout=10) as client:
        for request in (
            build_request("x" * (limit + 1)),
            build_request(messages=[{"role": "user", "content": "x" * (limit + 1)}]),
        ):
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(request))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert tokenizer.calls == 0
        assert client.generate_text("x" * 100, max_new_tokens=2)
        assert tokenizer.calls == 1


def test_near_max_message_prompts_leave_memory_flat(server: ServerThread) -> None:
    # Before the byte limit each 3.9 MB prompt was tokenized whole (~790,000 tokens) and the memory kept.
    prompt = "word " * (780 * 1024)
    rss = psutil.Process().memory_info().rss
    with Client(server.address, timeout=60) as client:

        def send(_: int) -> grpc.StatusCode:
            try:
                list(client.generate(prompt, max_new_tokens=2))
            except grpc.RpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(send, range(8)))
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 8
    # Measured: 151 MiB here (the messages' own buffers, kept by the allocator), 1,589 MiB without the limit.
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 400 * 2**20, f"resident memory grew {grown / 2**20:.0f} MiB"


# -- messages gRPC itself would mishandle --------------------------------------------------------------------


@pytest.mark.parametrize("method", ["Generate", "Tokenize", "GetSession", "DeleteSession", "GetModelInfo"])
def test_undecodable_request_is_invalid_argument_without_a_traceback(
    fake: ServerThread, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = f"/llmserve.v1.GenerateService/{method}"
    with grpc.insecure_channel(fake.address) as channel, caplog.at_level(logging.DEBUG):
        call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)
        with pytest.raises(grpc.RpcError) as err:
            result = call(b"\xff\xff\xff\xff", timeout=10)
            list(result) if method == "Generate" else None
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request: is not a valid llmserve.v1.")
    assert bad_request_fields(err.value) == ["request"]
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_past_the_max_receive_size_is_resource_exhausted_and_the_server_stays_up() -> None:
    srv = ServerThread(FakeEngine(), max_receive_message_bytes=64 * 1024).start()
    try:
        with grpc.insecure_channel(srv.address) as channel, Client(srv.address, timeout=10) as client:
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate("x" * 100_000))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert client.generate_text("x" * 100, max_new_tokens=2)
    finally:
        srv.stop()


# -- RESOURCE_EXHAUSTED says when to come back ---------------------------------------------------------------


def _retry_delay_s(err: grpc.RpcError) -> float | None:
    status = rpc_status.from_call(err)
    for detail in status.details if status else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


def test_admission_cap_and_full_queue_carry_retry_info() -> None:
    srv = ServerThread(FakeEngine(step_s=0.05), max_concurrent_streams=1).start()
    try:
        with Client(srv.address, timeout=10) as client:
            held = client.generate("hi", max_new_tokens=100)
            next(held)
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate("hi", max_new_tokens=2))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-streams" in err.value.details()
            assert _retry_delay_s(err.value) == 1.0
            held.close()
            srv.engine.queue_full = True
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate("hi", max_new_tokens=2))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _retry_delay_s(err.value) == 1.0
    finally:
        srv.stop()
