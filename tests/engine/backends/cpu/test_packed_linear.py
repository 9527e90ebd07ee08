"""float32 CPU linears through packed oneDNN weights compute what the plain layers compute."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.backends.cpu import packed_linear
from llmserve.engine.config import EngineConfig
from llmserve.engine.core import EngineCore
from llmserve.models import from_config
from llmserve.testing import TINY_VOCAB, tiny_config

# Decided without the function under test, so that a broken `available` fails here instead of skipping.
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
pytestmark = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN linear")


def test_available_exactly_for_float32_on_the_cpu() -> None:
    assert packed_linear.available(torch.device("cpu"), torch.float32)
    assert not packed_linear.available(torch.device("cpu"), torch.float64)
    assert not packed_linear.available(torch.device("cpu"), torch.bfloat16)
    assert not packed_linear.available(torch.device("meta"), torch.float32)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2's q/k/v projections have biases
def test_packed_model_gives_the_same_logits(family: str) -> None:
    loaded = from_config(tiny_config(family), dtype=torch.float32)
    model = loaded.model
    ids = torch.randint(TINY_VOCAB, (1, 57), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert packed_linear.pack_linears(model) == linears > 0
    assert packed_linear.pack_linears(model) == 0  # idempotent
    with torch.inference_mode():
        packed = model(input_ids=ids).logits
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    assert packed.argmax(-1).tolist() == plain.argmax(-1).tolist()


def test_engine_packs_float32_only_and_can_be_told_not_to() -> None:
    on, off = EngineConfig(kv_cache_tokens=256), EngineConfig(kv_cache_tokens=256, packed_linear=False)
    assert EngineCore(from_config(tiny_config(), dtype=torch.float32), on).backend.num_packed_linears > 0
    assert EngineCore(from_config(tiny_config(), dtype=torch.float32), off).backend.num_packed_linears == 0
    f64 = from_config(tiny_config(), dtype=torch.float64)
    assert EngineCore(f64, on).backend.num_packed_linears == 0
    assert packed_linear.pack_linears(f64.model) == 0
