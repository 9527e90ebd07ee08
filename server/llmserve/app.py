"""The grpc.aio server: GenerateService, health, reflection, the error interceptor, and the process life cycle.

Life cycle of `run()`: bind and start with health NOT_SERVING (so probes get an answer while the model
loads), load the model, start and warm up the engine, flip health to SERVING. On SIGTERM/SIGINT: health
NOT_SERVING, refuse new Generate streams, let those in flight finish for the grace period, cancel the rest,
stop the engine, return (the process exits 0). A second signal skips what is left of the grace period.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from llmserve.config import Config, ServerConfig
from llmserve.metrics import ServerMetrics
from llmserve.service import SERVICE_NAME, GenerateServicer, status_for
from llmserve.tracing import Tracing
from llmserve.tracing import from_env as tracing_from_env
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

if TYPE_CHECKING:
    from llmserve.engine.protocol import Engine

log = logging.getLogger("llmserve")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Health is reported for the whole server ("") and for the service by name.
_HEALTH_NAMES = ("", SERVICE_NAME)
_DEAD_POLL_S = 1.0
REPLICA_KEY = "x-llmserve-replica"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns the errors GenerateService raises into gRPC statuses (with google.rpc details) via `status_for`,
    and ends every GenerateService call with `trailing_metadata` (the replica's name), whatever its status."""

    def __init__(self) -> None:
        self.trailing_metadata: tuple[tuple[str, str], ...] = ()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _stream_with_status(handler.unary_stream, self.trailing_metadata),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary_with_status(handler.unary_unary, self.trailing_metadata),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    status = status_for(exc)
    if status is None:
        raise exc
    s = rpc_status.to_status(status)
    # abort() replaces the trailing metadata set so far unless it is passed on.
    await context.abort(
        s.code, s.details, trailing_metadata=(*(context.trailing_metadata() or ()), *s.trailing_metadata)
    )


Trailing = tuple[tuple[str, str], ...]


def _unary_with_status(behaviour: Callable[..., Awaitable[Any]], trailing: Trailing) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.set_trailing_metadata(trailing)
        try:
            return await behaviour(request, context)
        except Exception as exc:  # noqa: BLE001 - _abort_for re-raises what it does not know
            await _abort_for(exc, context)

    return wrapped


def _stream_with_status(
    behaviour: Callable[..., AsyncIterator[Any]], trailing: Trailing
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        context.set_trailing_metadata(trailing)
        try:
            async for response in behaviour(request, context):
                yield response
        except Exception as exc:  # noqa: BLE001 - _abort_for re-raises what it does not know
            await _abort_for(exc, context)

    return wrapped


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS from PEM files; with a client CA, clients must present a certificate it signed."""
    key, chain = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca, require_client_auth=bool(client_ca))


class LLMServer:
    """One gRPC server: binds at construction, serves health and reflection from `start()`, and
    GenerateService once `serve(engine)` has started the engine."""

    def __init__(self, config: ServerConfig, *, tracing: Tracing | None = None) -> None:
        self.config = config
        errors = ErrorInterceptor()
        self._server = grpc.aio.server(
            interceptors=[errors],
            # Two servers on one port would split the traffic silently; fail to bind instead.
            options=[("grpc.so_reuseport", 0)],
        )
        self.servicer = GenerateServicer(config)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(self.servicer, self._server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        if config.reflection:
            names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self._server)
        if config.tls_cert is not None:
            self.port = self._server.add_secure_port(config.address, _server_credentials(config))
        else:
            self.port = self._server.add_insecure_port(config.address)
        self.replica = config.replica_name or f"{socket.gethostname()}:{self.port}"
        errors.trailing_metadata = ((REPLICA_KEY, self.replica),)
        self.metrics = ServerMetrics(self.replica, lambda: self.servicer.num_streams) if config.metrics_port else None
        self.tracing = tracing if tracing is not None or not config.tracing else tracing_from_env(self.replica)
        for observer in (self.metrics, self.tracing):
            if observer is not None:
                self.servicer.add_observer(observer)
        self.engine: Engine | None = None
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start answering: health NOT_SERVING, GenerateService UNAVAILABLE until `serve()`."""
        await self._set_health(_NOT_SERVING)  # the aio health servicer starts out SERVING
        await self._server.start()
        scheme = "TLS" if self.config.tls_cert else "plaintext"
        log.info("listening on %s (port %d, %s) as replica %s", self.config.address, self.port, scheme, self.replica)
        if self.metrics is not None:
            host = self.config.address.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
            self.metrics.serve(host, self.config.metrics_port)

    async def serve(self, engine: Engine) -> None:
        """Start and warm up `engine`, then serve it and report SERVING."""
        await engine.start()
        self.engine = engine
        self.servicer.attach(engine)
        if self.metrics is not None:
            self.metrics.attach(engine)
        await self._set_health(_SERVING)
        self._watchdog = asyncio.create_task(self._watch_engine(engine))
        log.info("serving %s", engine.model_info)

    async def stop(self, grace_s: float | None = None, *, force: asyncio.Event | None = None) -> None:
        """Drain: NOT_SERVING, refuse new streams, wait up to `grace_s` for those in flight (or until
        `force` is set), cancel the rest, stop the engine."""
        grace_s = self.config.grace_period_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        self.servicer.begin_drain()
        # gRPC's own graceful stop closes the listener and sends GOAWAY now (streams in flight go on), so a
        # proxy or balancer sends new calls to other replicas at once; the stop(0) below cancels what is left.
        closing = asyncio.ensure_future(self._server.stop(grace_s))
        if self.servicer.num_streams:
            log.info("draining %d streams for up to %.1f s", self.servicer.num_streams, grace_s)
            waits = [asyncio.ensure_future(self.servicer.wait_idle())]
            if force is not None:
                waits.append(asyncio.ensure_future(force.wait()))
            await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waits:
                waiter.cancel()
            if self.servicer.num_streams:
                log.warning("cancelling %d streams still in flight", self.servicer.num_streams)
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self._server.stop(0)  # cancels whatever is left, health watches included
        await closing
        if self.engine is not None:
            await self.engine.shutdown()
        if self.metrics is not None:
            self.metrics.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)
        log.info("stopped")

    async def _set_health(self, status: int) -> None:
        for name in _HEALTH_NAMES:
            await self.health.set(name, status)

    async def _watch_engine(self, engine: Engine) -> None:
        while not engine.dead:
            await asyncio.sleep(_DEAD_POLL_S)
        log.error("engine is dead (%s): reporting NOT_SERVING", engine.dead_reason)
        await self._set_health(_NOT_SERVING)


async def run(config: Config) -> None:
    """Serve until SIGTERM or SIGINT, then drain and return."""
    # Imported here so that `--help` and config errors answer without loading torch.
    from llmserve.engine.async_engine import AsyncEngine
    from llmserve.models import load_model

    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        log.info("received %s", signal.Signals(signum).name)
        (force if stop.is_set() else stop).set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    server = LLMServer(config.server)
    await server.start()
    m = config.model
    cache_root = Path(m.cache_dir) if m.cache_dir else None
    log.info("loading model %s on %s", m.spec or "(default)", m.device)
    loading = asyncio.ensure_future(
        asyncio.to_thread(load_model, m.spec, device=m.device, dtype=m.dtype, cache_root=cache_root)
    )
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            # Building the engine (KV allocation, weight packing, graph capture) takes seconds: off the loop,
            # so that health keeps answering NOT_SERVING meanwhile.
            engine = await asyncio.to_thread(AsyncEngine, loading.result(), config.engine)
            # Serve even when a signal came meanwhile: stop() below then shuts the engine down.
            await server.serve(engine)
            await stopping
        else:
            log.info("stopping before the model finished loading")
    finally:
        await server.stop(force=force)
