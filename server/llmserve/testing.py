"""Tiny random-weight model configs for the tests and the benchmarks' probes (two layers, grouped-query attention
where the family has it), and transformers' own greedy generation as the reference the engine is held to.

Shared by tests/ and benchmarks/, so neither imports the other; the served process never imports it."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

TINY_VOCAB = 512


def tiny_config(family: str = "llama", vocab_size: int = TINY_VOCAB, max_positions: int = 2048) -> PretrainedConfig:
    """A two-layer model of the given family with grouped-query attention where the family has it."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    if family == "gpt2":
        gpt2: dict[str, Any] = dict(
            n_embd=64, n_layer=2, n_head=4, n_positions=max_positions, bos_token_id=1, eos_token_id=2
        )
        return GPT2Config(vocab_size=vocab_size, **gpt2)
    raise ValueError(family)


def greedy_reference(model: Any, prompt: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generation, one prompt alone, exactly `max_new` tokens."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # never infer a mask from a pad id that may occur in the prompt
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens
