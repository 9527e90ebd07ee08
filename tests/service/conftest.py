"""Fixtures for the service tests: one in-process server per module over the real engine and a tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from harness import ServerThread, tiny_engine

from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """A serving LLMServer over the real engine and the tiny model, shared by the tests of a module."""
    srv = ServerThread(tiny_engine()).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> generate_pb2_grpc.GenerateServiceStub:
    return generate_pb2_grpc.GenerateServiceStub(channel)
