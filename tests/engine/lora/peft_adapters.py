"""Adapters made in the tests with PEFT (nothing downloaded): a LoraConfig with non-zero init on a copy of a base model,
saved with save_pretrained, and the same adapter merged into the base weights by PEFT (merge_and_unload) as the
reference the LoRA ops are held to."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(slots=True)
class MadeAdapter:
    folder: Path
    merged: Any  # the base model with this adapter merged in by PEFT, eval mode


def make_adapter(base: Any, folder: Path, seed: int, *, merge: bool = True, **lora: Any) -> MadeAdapter:
    """Save a PEFT LoRA adapter of `base` (left untouched) in `folder`: A and B drawn from `seed` (PEFT's
    init_lora_weights=False: both random, so the adapter changes the outputs), LoraConfig(**lora) otherwise."""
    from peft import LoraConfig, get_peft_model

    lora.setdefault("target_modules", ALL_TARGETS)
    lora.setdefault("init_lora_weights", False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora))
    peft_model.save_pretrained(str(folder))
    merged = peft_model.merge_and_unload() if merge else None
    if merged is not None:
        merged.eval()
    return MadeAdapter(folder, merged)
