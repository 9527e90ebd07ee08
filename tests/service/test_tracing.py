"""OpenTelemetry tracing of Generate calls, caught by the SDK's in-memory exporter."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import grpc
import pytest
from harness import ServerThread, tiny_engine
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from llmserve.app import LLMServer
from llmserve.config import from_args
from llmserve.telemetry import tracing
from llmserve_client import build_request
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class TracedServer(ServerThread):
    """The harness's server, with a tracer provider that keeps spans in memory."""

    def __init__(self, engine: object, exporter: InMemorySpanExporter) -> None:
        super().__init__(engine)
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.provider = provider

    async def _create(self) -> LLMServer:
        return LLMServer(self.config, tracing=tracing.Tracing(self.provider, "replica-a"))


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(exporter: InMemorySpanExporter) -> Iterator[TracedServer]:
    srv = TracedServer(tiny_engine(in_process=True), exporter).start()  # spans are the edge's: a core on a thread
    yield srv
    srv.stop()


def test_a_span_per_call_continues_the_callers_trace(traced: TracedServer, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
    with grpc.insecure_channel(traced.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = build_request(token_ids=list(range(1000, 1012)), max_new_tokens=5, ignore_eos=True)
        responses = list(stub.Generate(request, metadata=metadata, timeout=60))
    (span,) = exporter.get_finished_spans()
    assert span.name == "llmserve.v1.GenerateService/Generate"
    assert span.kind is SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID
    assert [e.name for e in span.events] == ["queued", "first_token", "finish"]
    times = [span.start_time, *(e.timestamp for e in span.events), span.end_time]
    assert times == sorted(times)
    usage = responses[-1].usage
    attrs = span.attributes
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens == 12
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens == 5
    assert attrs["llmserve.usage.cached_prompt_tokens"] == usage.cached_prompt_tokens
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert tuple(span.events[-1].attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert attrs["rpc.grpc.status_code"] == 0
    assert attrs["llmserve.replica"] == "replica-a"
    assert attrs["llmserve.session"] is False
    assert span.status.status_code is StatusCode.UNSET


def test_without_a_trace_context_the_span_is_a_root(traced: TracedServer, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    with grpc.insecure_channel(traced.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        list(stub.Generate(build_request(token_ids=[1000, 1001], max_new_tokens=1, session_id="t"), timeout=60))
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(build_request(token_ids=[1000], top_p=0.0), timeout=60))
    ok, invalid = exporter.get_finished_spans()
    assert ok.parent is None and invalid.parent is None
    assert ok.attributes["llmserve.session"] is True and invalid.attributes["llmserve.session"] is False
    assert ok.context.trace_id != invalid.context.trace_id
    # Refused before the engine took it: no queued or first-token event, and the caller's error is not the server's.
    assert [e.name for e in invalid.events] == ["finish"]
    assert invalid.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "gen_ai.usage.input_tokens" not in invalid.attributes
    assert invalid.status.status_code is StatusCode.UNSET


def test_tracing_is_off_by_default_and_set_up_from_the_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert from_args([]).server.tracing is False
    assert from_args(["--tracing"]).server.tracing is True
    assert from_args([], env={"LLMSERVE_TRACING": "1"}).server.tracing is True
    assert tracing.from_env(environ={"OTEL_SDK_DISABLED": "true"}) is None
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-east")
    t = tracing.from_env("r1", environ={"OTEL_TRACES_EXPORTER": "console"})
    assert t is not None and t.provider.resource.attributes["service.name"] == "llm-east"
    t.shutdown()
    with pytest.raises(SystemExit, match="unknown exporter"):
        tracing.from_env(environ={"OTEL_TRACES_EXPORTER": "zipkin-v0"})


def test_a_clear_error_when_opentelemetry_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match=r"pip install 'llmserve\[tracing\]'"):
        tracing.from_env(environ={})
