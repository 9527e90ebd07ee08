"""api/errors.py on its own: the google.rpc.Status each known error maps to (code, message, BadRequest and RetryInfo
details), and nothing for an error it does not know. What a caller then receives: tests/api/test_interceptor.py."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2

from llmserve.api.errors import (
    MAX_STATUS_MESSAGE_CHARS,
    RETRY_DELAY_S,
    FieldNotFound,
    ServiceError,
    StreamStalled,
    code_name,
    status_for,
)
from llmserve.engine.types.adapters import AdapterExists, AdapterNotFound, AdapterRefused, AdaptersBusy, UnknownAdapter
from llmserve.engine.types.errors import EngineDead, InvalidRequest, QueueFull
from llmserve.history import LeaseLost, StoreUnavailable


def violations(status) -> list[tuple[str, str]]:  # noqa: ANN001 - a google.rpc.Status
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    return [(v.field, v.description) for v in bad.field_violations]


def retry_delay_ns(status) -> int:  # noqa: ANN001 - a google.rpc.Status
    retry = error_details_pb2.RetryInfo()
    assert status.details[-1].Unpack(retry)
    return retry.retry_delay.ToNanoseconds()


def test_errors_map_to_statuses_with_their_details() -> None:
    """The field path and reason a caller sees, and the retry delay."""
    status = status_for(InvalidRequest("sampling.top_p", "must be in (0, 1]"))
    assert status.code == code_pb2.INVALID_ARGUMENT
    assert violations(status) == [("sampling.top_p", "must be in (0, 1]")]
    for exc, delay_ns in (
        (QueueFull("busy"), int(RETRY_DELAY_S * 1e9)),
        (ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=2.5), 2_500_000_000),
    ):
        status = status_for(exc)
        assert status.code == code_pb2.RESOURCE_EXHAUSTED and retry_delay_ns(status) == delay_ns
    assert status_for(ServiceError(grpc.StatusCode.NOT_FOUND, "no session")).details == []
    assert status_for(QueueFull("128 requests waiting")).message == "engine queue is full: 128 requests waiting"
    assert str(ServiceError(grpc.StatusCode.NOT_FOUND, "no session")) == "no session"
    # The code a call's record names: the status's, or an unmapped fault's type.
    assert (code_name(QueueFull("busy")), code_name(InvalidRequest("text", "x")), code_name(KeyError())) == (
        "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "KeyError",
    )  # fmt: skip


def test_a_stalled_stream_is_resource_exhausted_naming_the_flag() -> None:
    stalled = StreamStalled(2.5)
    assert stalled.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stalled.message == "the stream was aborted: the client read nothing for 2.5 s (--stream-stall-timeout)"
    assert status_for(stalled).code == code_pb2.RESOURCE_EXHAUSTED


def test_what_a_field_names_and_is_not_there_is_not_found_naming_the_field() -> None:
    """Generate's adapter that is not loaded reads as a missing field value, with BadRequest details."""
    status = status_for(UnknownAdapter("sql"))
    assert status.code == code_pb2.NOT_FOUND
    assert status.message == "adapter: no adapter named 'sql' is loaded"
    assert violations(status) == [("adapter", "no adapter named 'sql' is loaded")]
    found = status_for(FieldNotFound("session_id", "no such session"))
    assert (found.code, violations(found)) == (code_pb2.NOT_FOUND, [("session_id", "no such session")])


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (AdapterNotFound("/adapters/sql", "no adapter_config.json"), code_pb2.NOT_FOUND),
        (AdapterRefused("/adapters/sql", "rank 64 is over --max-lora-rank 16"), code_pb2.INVALID_ARGUMENT),
        (AdapterExists("sql"), code_pb2.ALREADY_EXISTS),
    ],
)
def test_an_adapter_that_cannot_be_loaded_names_its_file_or_name(exc: Exception, code: int) -> None:
    status = status_for(exc)
    assert (status.code, status.message, list(status.details)) == (code, str(exc), [])


def test_no_room_for_an_adapter_is_resource_exhausted_with_a_retry_delay() -> None:
    status = status_for(AdaptersBusy("sql", 4))
    assert status.code == code_pb2.RESOURCE_EXHAUSTED and "--max-cpu-loras" in status.message
    assert retry_delay_ns(status) == int(RETRY_DELAY_S * 1e9)


def test_engine_and_store_failures() -> None:
    dead = status_for(EngineDead("the step failed"))
    assert (dead.code, dead.message) == (code_pb2.UNAVAILABLE, "engine is dead: the step failed")
    store = status_for(StoreUnavailable("redis://10.0.0.5:6379/0", "connection refused"))
    assert store.code == code_pb2.UNAVAILABLE
    assert store.message.endswith("connection refused; calls without a session id are still served")
    lost = status_for(LeaseLost("s1"))
    assert lost.code == code_pb2.ABORTED
    assert lost.message == (
        "the turn was not kept: its lease on the session expired and another call continued it; retry"
    )


def test_long_messages_are_clipped_and_unknown_errors_are_not_mapped() -> None:
    for exc in (
        InvalidRequest("text", "x" * 10_000),
        ServiceError(grpc.StatusCode.NOT_FOUND, "y" * 10_000),
        StoreUnavailable("sqlite:/tmp/s", "z" * 10_000),
        AdapterRefused("/a", "w" * 10_000),
    ):
        assert len(status_for(exc).message) <= MAX_STATUS_MESSAGE_CHARS + len("...")
    assert status_for(KeyError("bug")) is None and status_for(RuntimeError("bug")) is None
