"""The edge's refusals and the google.rpc.Status every known error maps to.

Handlers raise exceptions (`InvalidRequest`, `QueueFull`, `EngineDead` from the engine, `ServiceError` and
the history store's errors from here); the interceptor in app.py turns each into its status with `status_for`.
"""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from llmserve.engine.types.adapters import AdapterExists, AdapterNotFound, AdapterRefused, AdaptersBusy, UnknownAdapter
from llmserve.engine.types.errors import EngineDead, InvalidRequest, QueueFull
from llmserve.history import LeaseLost, StoreUnavailable
from llmserve.telemetry.request_log import clip

# RESOURCE_EXHAUSTED answers carry google.rpc.RetryInfo with this delay: streams last seconds, not minutes.
RETRY_DELAY_S = 1.0
# Status messages are cut to this many characters (a backstop: messages quote only short prefixes).
MAX_STATUS_MESSAGE_CHARS = 500
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class ServiceError(Exception):
    """A refusal decided by the service itself (loading, draining, overloaded, not found...)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class StreamStalled(ServiceError):
    """The client read nothing for --stream-stall-timeout while a message waited on its flow control."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the stream was aborted: the client read nothing for {timeout_s:g} s (--stream-stall-timeout)",
        )


class FieldNotFound(Exception):
    """NOT_FOUND for what a request field names (an adapter): the message and the BadRequest details name the field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def status_for(exc: BaseException) -> status_pb2.Status | None:
    """The google.rpc.Status a known error maps to; None for anything else (a bug: gRPC reports UNKNOWN)."""
    if isinstance(exc, UnknownAdapter):  # Generate's adapter (the adapter RPCs name their field themselves)
        exc = FieldNotFound("adapter", str(exc))
    if isinstance(exc, (InvalidRequest, FieldNotFound)):
        code = code_pb2.INVALID_ARGUMENT if isinstance(exc, InvalidRequest) else code_pb2.NOT_FOUND
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.reason)
        status = status_pb2.Status(code=code, message=clip(str(exc), MAX_STATUS_MESSAGE_CHARS))
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        return status
    lora = _lora_status(exc)
    if lora is not None:
        return lora
    if isinstance(exc, QueueFull):
        status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=f"engine queue is full: {exc}")
        return _with_retry_info(status, RETRY_DELAY_S)
    if isinstance(exc, EngineDead):
        return status_pb2.Status(code=code_pb2.UNAVAILABLE, message=f"engine is dead: {exc}")
    if isinstance(exc, StoreUnavailable):
        message = f"{exc}; calls without a session id are still served"
        return status_pb2.Status(code=code_pb2.UNAVAILABLE, message=clip(message, MAX_STATUS_MESSAGE_CHARS))
    if isinstance(exc, LeaseLost):
        message = "the turn was not kept: its lease on the session expired and another call continued it; retry"
        return status_pb2.Status(code=code_pb2.ABORTED, message=message)
    if isinstance(exc, ServiceError):
        status = status_pb2.Status(code=exc.code.value[0], message=clip(exc.message, MAX_STATUS_MESSAGE_CHARS))
        return status if exc.retry_after_s is None else _with_retry_info(status, exc.retry_after_s)
    return None


def _lora_status(exc: BaseException) -> status_pb2.Status | None:
    """An adapter that cannot be read or loaded; the message names the file, or the name."""
    if isinstance(exc, AdapterNotFound):
        code = code_pb2.NOT_FOUND
    elif isinstance(exc, AdapterRefused):
        code = code_pb2.INVALID_ARGUMENT
    elif isinstance(exc, AdapterExists):
        code = code_pb2.ALREADY_EXISTS
    elif isinstance(exc, AdaptersBusy):
        status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=clip(str(exc), MAX_STATUS_MESSAGE_CHARS))
        return _with_retry_info(status, RETRY_DELAY_S)
    else:
        return None
    return status_pb2.Status(code=code, message=clip(str(exc), MAX_STATUS_MESSAGE_CHARS))


def code_name(exc: BaseException) -> str:
    """The status code's name a call that raised `exc` ends with; an unmapped fault is named by its type."""
    status = status_for(exc)
    return _CODE_NAMES[status.code] if status else type(exc).__name__


def _with_retry_info(status: status_pb2.Status, delay_s: float) -> status_pb2.Status:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(delay_s * 1e9))
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status
