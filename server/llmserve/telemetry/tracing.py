"""OpenTelemetry tracing of Generate calls: off unless `--tracing`, then set up by the standard OTEL_* variables.

One SERVER span per Generate call, a child of the caller's W3C trace context when the call's metadata
carries one (`traceparent`, through the propagators OTEL_PROPAGATORS names), with the events `queued`,
`first_token` and `finish` at the times they happened, and the token counts and finish reason as
attributes. The span is built when the call ends, from the record the servicer keeps anyway, with the
recorded start and event times, so a traced call costs nothing while it streams.

OpenTelemetry is an optional dependency (`pip install 'llmserve[tracing]'`); nothing here imports it until
tracing is turned on.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from llmserve.telemetry.call import CallRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("llmserve")

SPAN_NAME = "llmserve.v1.GenerateService/Generate"
MISSING = "--tracing needs OpenTelemetry, which is not installed: pip install 'llmserve[tracing]'"
# OpenTelemetry's RPC conventions: these codes mark a server span as failed; the others are the caller's doing.
_ERROR_CODES = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})


class Tracing:
    """Turns each finished Generate call into a span of `provider`'s tracer."""

    def __init__(self, provider: TracerProvider, replica: str = "") -> None:
        self.provider = provider
        self.replica = replica
        self._tracer = provider.get_tracer("llmserve")

    def call_finished(self, call: CallRecord) -> None:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {key: value for key, value in call.metadata if isinstance(value, str)}
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": "llmserve.v1.GenerateService",
            "rpc.method": call.method,
            "rpc.grpc.status_code": _code_number(call.code),
            "llmserve.session": call.has_session,
        }
        if self.replica:
            attributes["llmserve.replica"] = self.replica
        span = self._tracer.start_span(
            SPAN_NAME if call.method == "Generate" else f"llmserve.v1.GenerateService/{call.method}",
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=call.start_ns,
        )
        if call.queued is not None:
            span.add_event("queued", {"gen_ai.usage.input_tokens": call.prompt_tokens}, call.wall_ns(call.queued))
            span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": call.prompt_tokens,
                    "gen_ai.usage.output_tokens": call.completion_tokens,
                    "llmserve.usage.cached_prompt_tokens": call.cached_prompt_tokens,
                }
            )
        if call.first_token is not None:
            span.add_event("first_token", timestamp=call.wall_ns(call.first_token))
        finish: dict[str, Any] = {"rpc.grpc.status_code": _code_number(call.code)}
        if call.finish_reason is not None:
            finish["gen_ai.response.finish_reasons"] = [call.finish_reason]
            span.set_attribute("gen_ai.response.finish_reasons", [call.finish_reason])
        span.add_event("finish", finish, call.wall_ns(call.end))
        if call.code in _ERROR_CODES:
            span.set_status(Status(StatusCode.ERROR, call.code))
        span.end(end_time=call.wall_ns(call.end))

    def shutdown(self) -> None:
        """Export what is still buffered."""
        self.provider.shutdown()


def from_env(replica: str = "", environ: dict[str, str] | None = None) -> Tracing | None:
    """Tracing set up as the OTEL_* variables say (exporter, endpoint, sampler, resource, batching).

    OTEL_TRACES_EXPORTER: otlp (default; OTLP over gRPC, or over HTTP with OTEL_EXPORTER_OTLP_PROTOCOL=
    http/protobuf when that exporter is installed), console, or none. OTEL_SDK_DISABLED=true: no tracing.
    Raises SystemExit with an install hint when OpenTelemetry is missing.
    """
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing is on, but OTEL_SDK_DISABLED=true: no spans")
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise SystemExit(MISSING) from exc
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "llmserve"}))
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    for name in _names(env.get("OTEL_TRACES_EXPORTER", "otlp")):
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, env)))
    log.info("tracing on: exporters %s", env.get("OTEL_TRACES_EXPORTER", "otlp"))
    return Tracing(provider, replica)


def _names(value: str) -> list[str]:
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    return [] if names == ["none"] else names


def _exporter(name: str, env: dict[str, str] | os._Environ[str]) -> SpanExporter:
    try:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter()
        if name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            if protocol.startswith("http"):
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

                http: SpanExporter = HTTPExporter()
                return http
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
    except ImportError as exc:
        raise SystemExit(f"OTEL_TRACES_EXPORTER={name}: {exc.name} is not installed ({MISSING})") from exc
    raise SystemExit(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console or none)")


def _code_number(name: str) -> int:
    import grpc

    for code in grpc.StatusCode:
        if code.name == name:
            return int(code.value[0])
    return 2  # UNKNOWN
