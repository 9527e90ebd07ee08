"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import CONFIG
from tests.testing import mend_triton_interpreter, tiny_config

mend_triton_interpreter()  # every engine test that runs the varlen kernel on the CPU runs it through the interpreter


@pytest.fixture
async def engine():
    loaded = from_config(tiny_config(max_positions=512), dtype=torch.float64)
    eng = AsyncEngine(loaded, CONFIG)
    await eng.start()
    yield eng
    await eng.shutdown()
