"""api/servicer.py's own logic, without a server: the engine request it builds (conversion plus the deadline margin
and the cache salt), how a stream that ends without a finish ends the call, what observers of an ended call are told,
and the engine it waits for. Generate through a server: tests/service/test_service_generate.py,
test_service_errors.py and the rest of tests/service/."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_engine import FakeEngine

from llmserve_client import build_request, pb


def test_a_request_converts_to_the_engines_with_its_defaults() -> None:
    """Every sampling and stopping field reaches the engine as sent; unset ones take their documented defaults, and
    an unset max_new_tokens is the least of the server's default, the model's limit and the room left (at least 1)."""
    from types import SimpleNamespace

    from llmserve.api.servicer import DEADLINE_MARGIN_S, GenerateServicer
    from llmserve.config import ServerConfig
    from llmserve.engine.types.protocol import ModelInfo
    from llmserve.engine.types.request import SamplingParams, StoppingParams

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
    from llmserve.engine.types.outputs import Delta, FinishReason, Usage
    from llmserve.engine.types.request import GenerationRequest, StoppingParams
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
    from llmserve.engine.types.errors import InvalidRequest
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
