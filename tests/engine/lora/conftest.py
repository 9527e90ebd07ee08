"""The LoRA tests' base model; the adapters they make with PEFT come from peft_adapters.py."""

from __future__ import annotations

import pytest

from llmserve.engine.types.model import LoadedModel
from tests.testing import tiny_model


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    """The tiny two-layer Llama (hidden 64, intermediate 128, 4 heads / 2 kv heads), float32."""
    return tiny_model("llama")
