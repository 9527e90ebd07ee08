"""Tests for engine/types/model.py's ModelShape (and models/random_shapes.py): a config's dimensions read once, for
every family the engine serves, and the attention window read where the config enables it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import MistralConfig, Qwen2Config

from llmserve.engine.types.model import ModelShape, sliding_window
from llmserve.models.loader import from_config
from llmserve.models.random_shapes import RANDOM_SHAPES
from tests.testing import tiny_config


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "qwen2", "qwen3"])
def test_the_shape_matches_the_built_models_tensors(family: str) -> None:
    """Layers, heads, kv heads and head dim as the model's own modules have them; vocab as its logits."""
    loaded = from_config(tiny_config(family))
    shape, model = loaded.shape, loaded.model
    assert loaded.shape == ModelShape.of(model.config)
    assert shape.vocab_size == model.get_output_embeddings().weight.shape[0] == loaded.vocab_size
    assert shape.context_length == loaded.context_length
    if family == "gpt2":
        assert shape.num_layers == len(model.transformer.h)
        assert shape.num_heads * shape.head_dim == model.config.n_embd and shape.num_kv_heads == shape.num_heads
        return
    attn = model.model.layers[0].self_attn
    assert shape.num_layers == len(model.model.layers)
    assert attn.q_proj.out_features == shape.num_heads * shape.head_dim
    assert attn.k_proj.out_features == shape.num_kv_heads * shape.head_dim
    assert shape.group * shape.num_kv_heads == shape.num_heads
    assert shape.hidden_size == attn.q_proj.in_features == model.model.layers[0].mlp.down_proj.out_features
    assert shape.intermediate_size == model.model.layers[0].mlp.down_proj.in_features


def test_random_shapes_read_as_published() -> None:
    smollm = ModelShape.of(RANDOM_SHAPES["smollm2-135m"]())
    assert smollm == ModelShape(30, 9, 3, 64, 49152, 8192, None, 576, 1536)
    assert smollm.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4
    assert ModelShape.of(RANDOM_SHAPES["qwen3-0.6b"]()).head_dim == 128  # not hidden / heads (64)


def test_a_config_without_a_position_limit_is_refused() -> None:
    config = SimpleNamespace(num_attention_heads=2, hidden_size=32, num_hidden_layers=1, vocab_size=64)
    with pytest.raises(ValueError, match="n_positions"):
        ModelShape.of(config)


def test_sliding_window_is_read_where_the_config_enables_it() -> None:
    assert sliding_window(MistralConfig(sliding_window=256)) == 256
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(Qwen2Config(sliding_window=128, use_sliding_window=False)) is None
    assert sliding_window(Qwen2Config(sliding_window=128, use_sliding_window=True)) == 128
    assert sliding_window(tiny_config()) is None
    assert sliding_window(SimpleNamespace(sliding_window=64, use_sliding_window=False)) is None
    assert sliding_window(SimpleNamespace(sliding_window=64)) == 64  # no get_text_config, no switch: on

    class Multimodal:
        sliding_window = None

        def get_text_config(self) -> SimpleNamespace:
            return SimpleNamespace(sliding_window=32, use_sliding_window=True)

    assert sliding_window(Multimodal()) == 32  # the text model's window
    assert ModelShape.of(MistralConfig(sliding_window=256)).sliding_window == 256
