"""A model's shape, read from its config once, and the shapes that `random:<shape>` models are built in.

`ModelShape.of(config)` is the one place that reads a transformers config's dimensions (layers, heads, kv
heads, head dim, vocabulary, context, attention window), wherever the model came from; everything else (the KV
cache and its sizing, the fused forward, the compiled kernels' choice, the engine's context cap) takes the
`ModelShape` that `LoadedModel.shape` carries.

Importing it imports no transformers (the server's front end reads shapes without loading torch): the random
shapes' configs are imported where they are made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LlamaConfig, PretrainedConfig, Qwen3Config


@dataclass(slots=True, frozen=True)
class ModelShape:
    """The dimensions every part of the engine sizes itself from.

    `vocab_size` is the width of the logits (config.vocab_size), which may exceed the tokenizer's length.
    `context_length` is the model's position limit; `sliding_window` the attention window the config enables
    (Mistral; Qwen2 with use_sliding_window), or None. `hidden_size` is the residual stream's width and
    `intermediate_size` the MLP's (None where the config names none): the projections' shapes that LoRA adapters
    are checked against (engine/lora/adapters.py).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    sliding_window: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """Read from a transformers config (the text model's, for a multimodal one). Raises ValueError when it
        names no position limit."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(_first(text, "num_attention_heads", "n_head"))
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        hidden = int(_first(text, "hidden_size", "n_embd"))
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        context = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        if not context:
            raise ValueError("model config has neither max_position_embeddings nor n_positions")
        layers = int(_first(text, "num_hidden_layers", "n_layer"))
        inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
        return cls(
            layers,
            heads,
            kv_heads,
            head_dim,
            int(text.vocab_size),
            int(context),
            sliding_window(text),
            hidden,
            None if inner is None else int(inner),
        )

    @property
    def group(self) -> int:
        """Query heads per kv head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V of every layer for one token, at `element_size` bytes an element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def sliding_window(config: Any) -> int | None:
    """The attention window a model config enables, if any (Mistral; Qwen2 with use_sliding_window)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not window or not getattr(text, "use_sliding_window", True):
        return None
    return int(window)


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"model config has none of {', '.join(names)}")


# -- the shapes of `random:<shape>` models ---------------------------------------------------------------


def _smollm2_135m() -> LlamaConfig:
    # Read from SmolLM2-135M-Instruct's GGUF (as converted by convert_gguf); test_models checks they still agree.
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def _llama_1b() -> LlamaConfig:
    # Llama-3.2-1B's published dims, including its llama3 rope scaling.
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def _qwen3_0_6b() -> Qwen3Config:
    # Qwen3-0.6B's published dims (per-head q/k norms, head_dim 128 over a hidden size of 1024).
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )


def _tiny() -> LlamaConfig:
    # Two layers of width 64: a replica that starts in seconds on a busy CPU (tests/deploy runs three).
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


# `random:<name>`: "smollm2-135m" (the default model's exact dims), "qwen3-0.6b", "llama-1b" (Llama-3.2-1B's
# dims) or "tiny" (two layers of width 64, vocabulary 1024: for tests and demos).
RANDOM_SHAPES: dict[str, Callable[[], PretrainedConfig]] = {
    "smollm2-135m": _smollm2_135m,
    "qwen3-0.6b": _qwen3_0_6b,
    "llama-1b": _llama_1b,
    "tiny": _tiny,
}
