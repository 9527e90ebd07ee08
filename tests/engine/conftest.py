"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.async_engine import AsyncEngine
from llmserve.models import from_config
from llmserve.testing import tiny_config
from tests.engine.engine_helpers import CONFIG


def _mend_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(array), which NumPy 2.4 refuses for the
    one-element arrays its scalars are; a loop bound read from memory (a sequence's length) needs it. Every engine
    test that runs the varlen kernel on the CPU runs it through the interpreter (tests/conftest.py)."""
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    patch = interpreter._patch_lang_tensor

    def patch_with_scalar_index(tensor, scope):  # noqa: ANN001, ANN202
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_scalar_index


_mend_triton_interpreter()


@pytest.fixture
async def engine():
    loaded = from_config(tiny_config(max_positions=512), dtype=torch.float64)
    eng = AsyncEngine(loaded, CONFIG)
    await eng.start()
    yield eng
    await eng.shutdown()
