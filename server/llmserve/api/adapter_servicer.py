"""The AdapterService servicer: load, unload and list the LoRA adapters that GenerateRequest.adapter names.

The engine core keeps the adapters (engine/lora/serving.py); this edge checks the caller's right and the fields,
asks the engine, and turns its answers into protobuf. With authentication on, only the identities named by
--admin-identity may call it: loading reads files on the server and changes what every caller is served, so it is
an operator's act, not a caller's. Errors are raised as exceptions and mapped to statuses by the interceptor
(errors.py): a missing folder or file NOT_FOUND, a refused adapter INVALID_ARGUMENT (both name the file), a name in
use ALREADY_EXISTS, no room RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from llmserve.api.errors import FieldNotFound, ServiceError
from llmserve.auth import caller_identity
from llmserve.config import ServerConfig
from llmserve.engine.types.adapters import (
    AdapterInfo,
    ListAdapters,
    LoadAdapter,
    UnknownAdapter,
    UnloadAdapter,
    adapter_name_problem,
)
from llmserve.engine.types.errors import InvalidRequest
from llmserve_client.pb.llmserve.v1 import adapters_pb2 as pb
from llmserve_client.pb.llmserve.v1 import adapters_pb2_grpc

if TYPE_CHECKING:
    from llmserve.engine.types.protocol import Engine

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdapterService"].full_name
MAX_PATH_CHARS = 4096


class AdapterServicer(adapters_pb2_grpc.AdapterServiceServicer):
    """Serves llmserve.v1.AdapterService over the engine the GenerateServicer holds (`engine()`: None until the
    model has loaded)."""

    def __init__(self, config: ServerConfig, engine: Callable[[], Engine | None]) -> None:
        self._config = config
        self._engine = engine  # the attached Engine, or None while the model loads

    def _ready(self) -> Engine:
        if self._config.auth_enabled and caller_identity() not in self._config.admin_identities:
            raise ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                "AdapterService is for the identities named by the server's --admin-identity",
            )
        engine: Engine | None = self._engine()
        if engine is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if engine.adapters is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this server serves no LoRA adapters: start it with --enable-lora or --lora NAME=PATH",
            )
        return engine

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LoadAdapterResponse:
        engine = self._ready()
        _check_name(request.name)
        if not request.path:
            raise InvalidRequest("path", "must name the adapter's folder on the server")
        if len(request.path) > MAX_PATH_CHARS or "\x00" in request.path:
            raise InvalidRequest("path", f"must be at most {MAX_PATH_CHARS} characters, without NUL")
        answer = await engine.manage_adapters(LoadAdapter(request.name, request.path))
        assert answer.loaded is not None
        return pb.LoadAdapterResponse(adapter=to_pb(answer.loaded))

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.UnloadAdapterResponse:
        engine = self._ready()
        _check_name(request.name)
        try:
            answer = await engine.manage_adapters(UnloadAdapter(request.name))
        except UnknownAdapter as exc:
            raise FieldNotFound("name", str(exc)) from None
        return pb.UnloadAdapterResponse(draining_requests=answer.draining)

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListAdaptersResponse:
        engine = self._ready()
        answer = await engine.manage_adapters(ListAdapters())
        limits = answer.limits
        return pb.ListAdaptersResponse(
            adapters=[to_pb(info) for info in answer.adapters],
            max_loras=limits.max_loras,
            max_cpu_loras=limits.max_cpu_loras,
            max_lora_rank=limits.max_lora_rank,
        )


def _check_name(name: str) -> None:
    if not name:
        raise InvalidRequest("name", "must not be empty")
    problem = adapter_name_problem(name)
    if problem is not None:
        raise InvalidRequest("name", problem)


def to_pb(info: AdapterInfo) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=info.name,
        path=info.path,
        rank=info.rank,
        target_modules=list(info.target_modules),
        resident=info.resident,
        running_requests=info.running_requests,
        host_bytes=info.host_bytes,
    )
