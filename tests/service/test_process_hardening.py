"""The process under faults: a dead engine makes it drain and exit non-zero; SIGHUP re-reads the token file
without dropping streams. `python -m llmserve` (or a launcher around it) runs as a subprocess."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import wait_until
from server_process import ServerProcess

from llmserve_client import Client, build_request, pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

HERE = Path(__file__).resolve().parent
EXIT_ENGINE_DEAD = 3


def _long_request() -> pb.GenerateRequest:
    return build_request("Once upon a time", max_new_tokens=900, ignore_eos=True)


def _engine_child(pid: int) -> int:
    """The engine process of the server `pid` (its only child)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_dead_engine_drains_and_exits_non_zero(engine: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """On a thread, the core dies as after repeated failed forwards; in its own process, the process is killed
    (SIGKILL: nothing it could catch). Either way the stream in flight ends with an error and the server exits 3."""
    trigger = tmp_path / "kill-engine"
    args = ["--model", str(tiny_model_dir), "--kv-cache-tokens", "8192", "--grace-period", "30"]
    if engine == "thread":
        env = {"LLMSERVE_TEST_KILL_FILE": str(trigger)}
        process = ServerProcess(*args, "--engine-in-process", script=HERE / "dying_llmserve.py", env=env)
    else:
        process = ServerProcess(*args)
    try:
        port = process.wait_serving()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(_long_request(), timeout=60)
            received = [next(call)]
            if engine == "thread":
                trigger.touch()
            else:
                os.kill(_engine_child(process.proc.pid), signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as err:
                for response in call:
                    received.append(response)
            # The stream in flight hears of the failure (with what it had) instead of hanging.
            assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
            assert received[-1].finish_reason == pb.FINISH_REASON_ERROR
            assert wait_until(lambda: _status(health) != health_pb2.HealthCheckResponse.SERVING, timeout=10)
        assert process.proc.wait(timeout=60) == EXIT_ENGINE_DEAD
        log = "".join(process.log)
        assert "engine is dead" in log
        assert f"exiting with status {EXIT_ENGINE_DEAD}" in log
    finally:
        process.kill()


def _status(health: health_pb2_grpc.HealthStub) -> int:
    try:
        return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    except grpc.RpcError:
        return -1  # already gone


def test_sighup_reloads_the_token_file_without_dropping_streams(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.csv"
    tokens.write_text("token-alice,alice,1001\n")
    process = ServerProcess(
        "--model", str(tiny_model_dir), "--kv-cache-tokens", "8192", "--auth-token-file", str(tokens)
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{process.wait_serving()}"
        with Client(address, timeout=60, token="token-alice") as alice, Client(address, token="token-bob") as bob:
            stream = alice.generate(_long_request())
            received = [next(stream)]
            with pytest.raises(grpc.RpcError) as err:
                bob.generate_text("hi", max_new_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

            tokens.write_text("token-bob,bob\n")
            process.proc.send_signal(signal.SIGHUP)
            process.wait_for(r"auth token file .* reloaded: 1 tokens", timeout=10)
            assert bob.generate_text("hi", max_new_tokens=2) is not None
            with pytest.raises(grpc.RpcError) as err:
                alice.generate_text("hi", max_new_tokens=2, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

            tokens.write_text("no identity column\n")  # a broken file keeps the tokens in force
            process.proc.send_signal(signal.SIGHUP)
            process.wait_for(r"not reloaded, keeping 1 tokens: line 1: expected token,identity", timeout=10)
            assert bob.generate_text("hi", max_new_tokens=2) is not None

            # Alice's stream, admitted before her token was withdrawn, ran on to its end.
            received += list(stream)
            assert received[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert received[-1].usage.completion_tokens == 900
        assert "token-alice" not in "".join(process.log) and "token-bob" not in "".join(process.log)
    finally:
        process.kill()
