"""Fixtures for the service tests: one in-process server per module over the real engine and a tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from harness import ServerThread, tiny_engine
from server_process import save_tiny_model

from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A serving LLMServer over the real engine and the tiny model, shared by the tests of a module: its core in an
    engine process, as `python -m llmserve` runs it, unless the module sets ENGINE_IN_PROCESS (what it tests is
    the edge's alone, and a core on a thread starts in a tenth of the time)."""
    srv = ServerThread(tiny_engine(in_process=getattr(request.module, "ENGINE_IN_PROCESS", False))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> generate_pb2_grpc.GenerateServiceStub:
    return generate_pb2_grpc.GenerateServiceStub(channel)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and its tokenizer saved as a local transformers folder, for `--model` in a subprocess."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
