"""The grpc.aio server: GenerateService, health, reflection, the interceptors, and the process life cycle.

Life cycle of `run()`: bind and start with health NOT_SERVING (so probes get an answer while the model
loads), load the model, start and warm up the engine, flip health to SERVING. On SIGTERM/SIGINT: health
NOT_SERVING, refuse new Generate streams, let those in flight finish for the grace period, then stop the
engine (the streams it cuts get a last message and UNAVAILABLE), stop the server, return 0. A second signal
skips what is left of the grace period. SIGHUP re-reads the auth token file. When the engine dies, the
server drains the same way and `run()` returns EXIT_ENGINE_DEAD, so that a supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib
import logging
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from llmserve.api.adapter_servicer import SERVICE_NAME as ADAPTER_SERVICE_NAME
from llmserve.api.adapter_servicer import AdapterServicer
from llmserve.api.admission import Admission
from llmserve.api.interceptor import ErrorInterceptor
from llmserve.api.servicer import SERVICE_NAME, GenerateServicer
from llmserve.api.vllm_servicer import VLLM_SERVICE_NAME, VllmEngineServicer
from llmserve.auth import Authenticator, AuthInterceptor, TokenStore
from llmserve.config import Config, ServerConfig
from llmserve.history import StoreUnavailable, open_store
from llmserve.telemetry.metrics import ServerMetrics
from llmserve.telemetry.tracing import Tracing
from llmserve.telemetry.tracing import from_env as tracing_from_env
from llmserve_client.pb.llmserve.v1 import adapters_pb2_grpc, generate_pb2_grpc

if TYPE_CHECKING:
    from llmserve.engine.types.protocol import Engine

log = logging.getLogger("llmserve")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Health is reported for the whole server ("") and for each service by name.
_HEALTH_NAMES = ("", SERVICE_NAME, VLLM_SERVICE_NAME)
_DEAD_POLL_S = 1.0
REPLICA_KEY = "x-llmserve-replica"
# Exit status of the process when the engine died (0 is a clean shutdown, 1 an unexpected error).
EXIT_ENGINE_DEAD = 3
# Exit status when the session history store does not answer at start (and --history-store-optional is off).
EXIT_STORE_UNAVAILABLE = 2
# After the engine stops, how long the streams it cut get to send their last message before the server stops.
_FINAL_MESSAGES_S = 2.0
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_REFLECTION_PREFIX = "/grpc.reflection."


class _HealthServicer(health_aio.HealthServicer):  # type: ignore[misc]  # grpc_health is untyped
    """grpc.health.v1.Health with List, which grpcio-health-checking's servicer leaves unimplemented (a
    call to it otherwise ends UNKNOWN with a traceback in the log)."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthListResponse:
        statuses = {name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()}
        return health_pb2.HealthListResponse(statuses=statuses)


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS from PEM files; with a client CA, clients must present a certificate it signed."""
    if config.tls_key is None or config.tls_cert is None:
        raise ValueError("TLS needs --tls-cert and --tls-key")
    key, chain = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca, require_client_auth=bool(client_ca))


class LLMServer:
    """One gRPC server: binds at construction, serves health and reflection from `start()`, and
    GenerateService once `serve(engine)` has started the engine."""

    def __init__(self, config: ServerConfig, *, tracing: Tracing | None = None) -> None:
        self.config = config
        self.authenticator = _authenticator(config)
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.authenticator is not None:
            exempt = [_HEALTH_PREFIX] if config.reflection_requires_auth else [_HEALTH_PREFIX, _REFLECTION_PREFIX]
            interceptors.append(AuthInterceptor(self.authenticator, exempt=exempt))
        interceptors.append(ErrorInterceptor(config.stream_stall_timeout_s, lambda: ((REPLICA_KEY, self.replica),)))
        self._server = grpc.aio.server(interceptors=interceptors, options=_server_options(config))
        self.health = _HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        if config.reflection:
            health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
            names = (SERVICE_NAME, ADAPTER_SERVICE_NAME, VLLM_SERVICE_NAME, health, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self._server)
        if config.tls_cert is not None:
            self.port = self._server.add_secure_port(config.address, _server_credentials(config))
        else:
            self.port = self._server.add_insecure_port(config.address)
        self.replica = config.replica_name or f"{socket.gethostname()}:{self.port}"
        self.engine: Engine | None = None
        histories = open_store(config.history)  # connected by start(), closed by stop()
        admission = Admission.of(config)
        self.metrics = (
            ServerMetrics(self.replica, admission.__len__, lambda: self.engine, histories)
            if config.metrics_port
            else None
        )
        self.tracing = tracing if tracing is not None or not config.tracing else tracing_from_env(self.replica)
        observers = [o for o in (self.metrics, self.tracing) if o is not None]
        self.servicer = GenerateServicer(config, observers, histories, admission)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(self.servicer, self._server)
        # vLLM's engine protocol over the same calls, for smg (which takes a worker for the first engine answering).
        self.vllm_servicer = VllmEngineServicer(
            self.servicer, self.metrics.kv_event_batches.inc if self.metrics is not None else None
        )
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, self._server)
        self.adapter_servicer = AdapterServicer(config, lambda: self.servicer.engine)
        adapters_pb2_grpc.add_AdapterServiceServicer_to_server(self.adapter_servicer, self._server)
        self._watchdog: asyncio.Task[None] | None = None
        # Set when the engine has died: run() then drains and returns EXIT_ENGINE_DEAD.
        self.engine_died = asyncio.Event()

    async def start(self) -> None:
        """Connect the history store (StoreUnavailable unless --history-store-optional), then start
        answering: health NOT_SERVING, GenerateService UNAVAILABLE until `serve()`."""
        histories = self.servicer.histories
        try:
            await histories.connect()
        except StoreUnavailable as exc:
            if not self.config.history.optional:
                raise
            log.warning("%s: serving calls without a session id only until it answers (--history-store-optional)", exc)
        else:
            log.info("session histories in %s", histories.name)
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
        await self._set_health(_SERVING)
        self._watchdog = asyncio.create_task(self._watch_engine(engine))
        log.info("serving %s", engine.model_info)

    def reload_credentials(self) -> None:
        """Re-read the auth token file (SIGHUP); streams in flight are not touched."""
        if self.authenticator is not None:
            self.authenticator.reload()

    async def stop(self, grace_s: float | None = None, *, force: asyncio.Event | None = None) -> None:
        """Drain: NOT_SERVING, refuse new streams, wait up to `grace_s` for those in flight (or until
        `force` is set), then stop the engine, whose cut streams end with a last message (finish reason
        CANCELLED, usage) and UNAVAILABLE, and stop the server, cancelling whatever is left."""
        grace_s = self.config.grace_period_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        self.servicer.begin_drain()
        # gRPC's own graceful stop closes the listener and sends GOAWAY now (streams in flight go on), so a
        # proxy or balancer sends new calls to other replicas at once; the stop(0) below cancels what is left.
        # Its grace outlasts ours, so that the streams the engine cuts still send their last message.
        closing = asyncio.ensure_future(self._server.stop(grace_s + _FINAL_MESSAGES_S + 1.0))
        if self.servicer.num_streams:
            log.info("draining %d streams for up to %.1f s", self.servicer.num_streams, grace_s)
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.servicer.wait_idle())]
            if force is not None:
                waits.append(asyncio.ensure_future(force.wait()))
            await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waits:
                waiter.cancel()
            if self.servicer.num_streams:
                log.warning("cancelling %d streams still in flight", self.servicer.num_streams)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.engine is not None:
            # The engine first: it ends each request it still runs with a last delta, which the streams
            # can still send while the server is up.
            await self.engine.shutdown()
            if self.servicer.num_streams:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.servicer.wait_idle(), _FINAL_MESSAGES_S)
        await self._server.stop(0)  # cancels whatever is left, health watches included
        await closing
        await self.servicer.histories.close()
        self.vllm_servicer.close()
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
        log.error("engine is dead (%s): reporting NOT_SERVING, draining and exiting", engine.dead_reason)
        await self._set_health(_NOT_SERVING)
        self.engine_died.set()


def _authenticator(config: ServerConfig) -> Authenticator | None:
    if config.auth_token_file is not None:
        return Authenticator(TokenStore(config.auth_token_file), from_certificate=False)
    if config.identity_from_cert:
        return Authenticator(None, from_certificate=True)
    return None


def _server_options(config: ServerConfig) -> list[tuple[str, int]]:
    ping_ms = int(config.keepalive_min_ping_interval_s * 1000)
    return [
        # Two servers on one port would split the traffic silently; fail to bind instead.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", config.max_receive_message_bytes),
        # Clients may ping this often (gRPC's default is once per 5 minutes, past which it answers GOAWAY
        # "too_many_pings" and kills every stream of the connection, idle long streams included).
        ("grpc.http2.min_ping_interval_without_data_ms", ping_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # And the server pings quiet connections itself, so that streams of vanished clients free their slots.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]


async def run(config: Config) -> int:
    """Serve until SIGTERM or SIGINT (return 0) or until the engine dies (return EXIT_ENGINE_DEAD),
    draining in-flight streams before returning."""
    # Imported here so that `--help` and config errors answer without loading torch (core/process.py loads none).
    from llmserve.engine.core.process import ChildSpec, ProcessCore, load_served_model
    from llmserve.engine.kv_tiers.disk import check_folder

    if config.engine.kv_offload_dir is not None:
        # Refused before the model loads (DiskTierError: exit 2), not seconds later from the engine process.
        check_folder(Path(config.engine.kv_offload_dir))
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        log.info("received %s", signal.Signals(signum).name)
        (force if stop.is_set() else stop).set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    server = LLMServer(config.server)
    loop.add_signal_handler(signal.SIGHUP, server.reload_credentials)
    try:
        await server.start()
    except StoreUnavailable as exc:
        log.error(
            "%s; exiting with status %d (--history-store-optional serves calls without a session id)",
            exc,
            EXIT_STORE_UNAVAILABLE,
        )
        await server.stop(0)
        return EXIT_STORE_UNAVAILABLE
    m = config.model
    load = functools.partial(load_served_model, m, config.engine.lora_enabled)
    # The engine process starts first; with it, this process never imports torch (the child sends the model's card).
    child = ChildSpec(load, config.engine, config.server.log_level, config.server.log_format)
    core = ProcessCore(child) if m.engine_process else None
    # The engine's modules load off the event loop (torch with them for a core on a thread: seconds), meanwhile
    # health answers NOT_SERVING.
    engines = await asyncio.to_thread(importlib.import_module, "llmserve.engine.frontend.async_engine")
    log.info("loading model %s on %s%s", m.spec or "(default)", m.device, " in the engine process" if core else "")
    building = asyncio.ensure_future(engines.build_engine(load, config.engine, core))
    stopping = asyncio.ensure_future(stop.wait())
    dying = asyncio.ensure_future(server.engine_died.wait())
    try:
        await asyncio.wait([building, stopping], return_when=asyncio.FIRST_COMPLETED)
        if building.done():
            # Serve even when a signal came meanwhile: stop() below then shuts the engine down.
            await server.serve(building.result())
            gc.freeze()  # what start-up left lives as long as the process: the collector need not walk it again
            await asyncio.wait([stopping, dying], return_when=asyncio.FIRST_COMPLETED)
        else:
            log.info("stopping before the model finished loading")
            building.cancel()  # kills the engine process if there is one
    finally:
        for waiter in (stopping, dying):
            waiter.cancel()
        await server.stop(force=force)
    if server.engine_died.is_set():
        log.error("exiting with status %d: the engine died", EXIT_ENGINE_DEAD)
        return EXIT_ENGINE_DEAD
    return 0
