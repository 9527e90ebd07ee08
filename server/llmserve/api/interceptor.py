"""The gRPC edge's interceptor: errors the handlers raise become statuses with google.rpc details (`status_for`),
undecodable requests INVALID_ARGUMENT naming `request`, a stream whose client reads nothing is aborted, and every
call ends with the replica's trailing metadata. It wraps llmserve.v1.GenerateService and vllm.grpc.engine.VllmEngine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_status import rpc_status
from smg_grpc_proto.generated import vllm_engine_pb2

from llmserve.api.adapter_servicer import SERVICE_NAME as ADAPTER_SERVICE_NAME
from llmserve.api.errors import StreamStalled, status_for
from llmserve.api.servicer import SERVICE_NAME
from llmserve.api.vllm_servicer import VLLM_SERVICE_NAME
from llmserve.engine.types.errors import InvalidRequest
from llmserve_client.pb.llmserve.v1 import adapters_pb2, generate_pb2

_SERVICES = {  # whose errors the ErrorInterceptor maps: llmserve's own, and vLLM's engine protocol
    SERVICE_NAME: generate_pb2.DESCRIPTOR.services_by_name["GenerateService"],
    VLLM_SERVICE_NAME: vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
    ADAPTER_SERVICE_NAME: adapters_pb2.DESCRIPTOR.services_by_name["AdapterService"],
}


class Undecodable:
    """What the request deserializer returns for bytes protobuf cannot parse; the call then ends
    INVALID_ARGUMENT naming `request` (gRPC itself would answer UNKNOWN and log a traceback)."""

    def __init__(self, message_name: str) -> None:
        self.message_name = message_name

    def error(self) -> InvalidRequest:
        return InvalidRequest("request", f"is not a valid {self.message_name} message")


def _tolerant(deserializer: Callable[[bytes], Any] | None, message_name: str) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            return Undecodable(message_name)

    return deserialize


Trailing = tuple[tuple[str, str], ...]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """For GenerateService and VllmEngine: turns the errors it raises into gRPC statuses (with google.rpc details)
    via `status_for`, answers undecodable requests INVALID_ARGUMENT, aborts a stream whose next message has
    waited on the client's flow control for `stall_timeout_s` (the client reads nothing), and ends every
    call with `trailing_metadata()` (the replica's name), whatever its status: read per call, as the name
    holds the port, bound only after the server has taken its interceptors."""

    def __init__(self, stall_timeout_s: float, trailing_metadata: Callable[[], Trailing]) -> None:
        self._trailing_metadata = trailing_metadata
        self._stall_timeout_s = stall_timeout_s

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        service_name, _, rpc_name = handler_call_details.method.lstrip("/").partition("/")
        service = _SERVICES.get(service_name)
        if handler is None or service is None:
            return handler
        rpc = service.methods_by_name.get(rpc_name)
        deserializer = _tolerant(handler.request_deserializer, rpc.input_type.full_name if rpc else "request")
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _stream_with_status(handler.unary_stream, self._trailing_metadata(), self._stall_timeout_s),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary_with_status(handler.unary_unary, self._trailing_metadata()),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    status = status_for(exc)
    if status is None:
        raise exc
    s = rpc_status.to_status(status)
    # abort() replaces the trailing metadata set so far unless it is passed on.
    await context.abort(
        s.code, s.details, trailing_metadata=(*(context.trailing_metadata() or ()), *s.trailing_metadata)
    )


def _unary_with_status(behaviour: Callable[..., Awaitable[Any]], trailing: Trailing) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        context.set_trailing_metadata(trailing)
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            return await behaviour(request, context)
        except Exception as exc:  # noqa: BLE001 - _abort_for re-raises what it does not know
            await _abort_for(exc, context)

    return wrapped


def _stream_with_status(
    behaviour: Callable[..., Any], trailing: Trailing, stall_timeout_s: float
) -> Callable[..., Awaitable[None]]:
    # Writes with context.write rather than by being a generator, so that a write stuck on the client's
    # flow control can be timed out; the stall is thrown into the servicer's generator at its yield.
    async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        context.set_trailing_metadata(trailing)
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            async with contextlib.aclosing(behaviour(request, context)) as responses:
                async for response in responses:
                    try:
                        async with asyncio.timeout(stall_timeout_s):
                            await context.write(response)
                    except TimeoutError:
                        await responses.athrow(StreamStalled(stall_timeout_s))
        except Exception as exc:  # noqa: BLE001 - _abort_for re-raises what it does not know
            await _abort_for(exc, context)

    return wrapped
