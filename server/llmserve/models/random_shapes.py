"""The shapes that `random:<shape>` models are built in (loader.random_model): transformers configs of known models'
dimensions, with random weights drawn from a seed. Each config is imported where it is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig, PretrainedConfig, Qwen3Config


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
