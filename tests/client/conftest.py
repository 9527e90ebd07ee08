"""Fixtures for the client tests: the service tests' harness runs the server they talk to."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The harness lives with the service tests; share it rather than keep a second copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from harness import ServerThread, tiny_engine  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """A serving LLMServer over the real engine and the tiny model, shared by the tests of a module."""
    srv = ServerThread(tiny_engine(in_process=True)).start()  # the client's tests: the engine's mode is not theirs
    yield srv
    srv.stop()
