"""The process: `python -m llmserve` as a subprocess (health at start, SIGTERM drain, exit 0), and reflection."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_engine import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from harness import ServerThread, tiny_model
from server_process import ServerProcess, save_tiny_model

from llmserve_client import build_request, pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_reflection_lists_the_services() -> None:
    srv = ServerThread(FakeEngine()).start()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
            assert "llmserve.v1.GenerateService" in services
            assert "grpc.health.v1.Health" in services
    finally:
        srv.stop()


def test_reflection_can_be_turned_off() -> None:
    srv = ServerThread(FakeEngine(), reflection=False).start()
    try:
        with grpc.insecure_channel(srv.address) as channel, pytest.raises(grpc.RpcError) as err:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and its tokenizer saved as a local transformers folder, for `--model`."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def server_process(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess("--model", str(tiny_model_dir), "--grace-period", "30", "--kv-cache-tokens", "8192")
    yield process
    process.kill()


def test_sigterm_drains_in_flight_streams_and_exits_zero(server_process: ServerProcess) -> None:
    port = int(server_process.wait_for(r"listening on .* \(port (\d+),", timeout=60).group(1))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        # Health, watched from the moment the port is open: NOT_SERVING while loading, then SERVING.
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
        statuses = []
        for response in watch:
            statuses.append(response.status)
            if response.status == SERVING:
                break
        assert statuses[-1] == SERVING and set(statuses[:-1]) <= {NOT_SERVING}, statuses

        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        call = stub.Generate(build_request("Once upon a time", max_new_tokens=300, ignore_eos=True), timeout=60)
        received = [next(call)]
        server_process.proc.send_signal(signal.SIGTERM)

        assert next(watch).status == NOT_SERVING
        received += list(call)  # the stream in flight finishes within the grace period
        assert received[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert received[-1].usage.completion_tokens == 300

    assert server_process.proc.wait(timeout=30) == 0
    log = "".join(server_process.log)
    assert "received SIGTERM" in log
    assert re.search(r"request_id=\w+ status=OK finish=length prompt_tokens=\d+ .*completion_tokens=300", log)
    assert "Once upon a time" not in log, "prompts are not logged unless --log-prompts"


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps (Linux)")
def test_the_front_end_serves_without_loading_torch(server_process: ServerProcess) -> None:
    """With the engine in its own process (the default), the front end tokenizes, checks a grammar, streams and
    detokenizes without ever loading torch (its libraries never mapped into the process); the engine process has."""
    port = server_process.wait_serving()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        plain = list(stub.Generate(build_request("Once upon a time", max_new_tokens=8, ignore_eos=True), timeout=60))
        shaped = list(stub.Generate(build_request("{", max_new_tokens=40, json_schema=schema), timeout=60))
    assert plain[-1].usage.completion_tokens == 8 and "".join(m.text for m in plain)
    assert shaped[-1].finish_reason != pb.FINISH_REASON_ERROR and shaped[-1].usage.completion_tokens > 0
    children = [
        int(p)
        for p in Path(f"/proc/{server_process.proc.pid}/task/{server_process.proc.pid}/children").read_text().split()
    ]
    assert "libtorch" not in _maps(server_process.proc.pid)
    assert any("libtorch" in _maps(child) for child in children), children


def test_sigint_with_nothing_in_flight_exits_promptly(server_process: ServerProcess) -> None:
    server_process.wait_for(r"serving ", timeout=120)
    started = time.monotonic()
    server_process.proc.send_signal(signal.SIGINT)
    assert server_process.proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 10


def test_health_answers_not_serving_while_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run()` itself, with the model load held open: every probe answers NOT_SERVING at once until the model
    is there, then SERVING; SIGTERM ends it with nothing in flight. (The engine in this process, so that the
    held load is this test's; with an engine process the same wait is the child's, as every server_process
    test sees.)"""
    import llmserve.app as app
    import llmserve.models.loader as models
    from llmserve.config import from_args

    release = threading.Event()
    servers: list[app.LLMServer] = []

    def held_load(*args: object, **kwargs: object) -> object:
        assert release.wait(60), "the test never released the load"
        return tiny_model()

    class Recorded(app.LLMServer):
        def __init__(self, config: object) -> None:
            super().__init__(config)
            servers.append(self)

    monkeypatch.setattr(models, "load_model", held_load)
    monkeypatch.setattr(app, "LLMServer", Recorded)
    config = from_args(["--address", "127.0.0.1:0", "--kv-cache-tokens", "4096", "--engine-in-process"], env={})
    probes: list[tuple[int, float]] = []
    failures: list[BaseException] = []

    def probe() -> None:
        try:
            deadline = time.monotonic() + 60
            while not servers and time.monotonic() < deadline:
                time.sleep(0.01)
            with grpc.insecure_channel(f"127.0.0.1:{servers[0].port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service="")
                while time.monotonic() < deadline:
                    started = time.monotonic()
                    status = health.Check(request, timeout=5, wait_for_ready=True).status
                    probes.append((status, time.monotonic() - started))
                    if status == SERVING:
                        break
                    if len(probes) == 10:
                        release.set()  # ten NOT_SERVING answers while loading: let the model arrive
                    time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)
        finally:
            release.set()
            os.kill(os.getpid(), signal.SIGTERM)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    asyncio.run(app.run(config))
    prober.join(timeout=30)
    assert not failures, failures
    statuses = [status for status, _ in probes]
    assert statuses[:10] == [NOT_SERVING] * 10 and statuses[-1] == SERVING, statuses
    assert max(seconds for _, seconds in probes) < 1.0, probes
