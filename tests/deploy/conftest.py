"""Fixtures for the smg tests: the gateway in front of the module's own `replica` fixture (each smg test module
serves its own model)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.replicas import Replica
from tests.deploy.smg import Smg, in_front


@pytest.fixture(scope="module")
def gateway(replica: Replica, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Smg, str]]:
    """smg in front of the module's `replica`, ready: the gateway and the served model's id."""
    with in_front([replica], tmp_path_factory.mktemp("smg")) as ready:
        yield ready
