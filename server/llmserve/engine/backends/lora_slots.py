"""A backend's LoRA slots: the stacked factors of the adapters a step runs, and each packed row's slot.

The engine core keeps the books (which adapter is in which of the `--max-loras` slots, lora/slot_books.py) and
puts in each step's plan the copies to make (`StepPlan.lora_writes`, before the forward) and each entry's slot
(`SeqStep.lora_slot`, NO_ADAPTER for the base model). Here those become tensors: `write` copies an adapter's
factors into its slot, and `rows` turns the packed row's entries into the per-token slots that the LoRA ops read
(lora/ops.LoraRows, None when every entry is base: the forward then adds nothing).

Two forwards apply them: the CPU's fused forward calls the ops itself (lora/weights.FUSED_GROUPS: q/k/v and gate/up
fused), and a forward through transformers' own modules (the torch and CUDA backends, and the CPU without the fused
forward) gets forward hooks on each target projection (lora/hooks.py, MODULE_GROUPS).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from llmserve.engine.backends.cpu.gguf_linear import QuantProjection
from llmserve.engine.config import EngineConfig
from llmserve.engine.lora.adapters import LoraAdapter
from llmserve.engine.lora.hooks import LoraHooks
from llmserve.engine.lora.ops import NO_ADAPTER, LoraRows
from llmserve.engine.lora.weights import FUSED_GROUPS, MODULE_GROUPS, LoraWeights
from llmserve.engine.sched.plan import SeqStep
from llmserve.engine.types.model import ModelShape


class BackendLora:
    """The slots' weights on the backend's device; hooks on `model` unless the forward is the fused one."""

    def __init__(
        self, config: EngineConfig, shape: ModelShape, model: Any, dtype: torch.dtype, device: torch.device, *,
        fused: bool,
    ) -> None:  # fmt: skip
        self.max_loras = config.max_loras
        self.dtype, self.device = dtype, device
        groups = FUSED_GROUPS if fused else MODULE_GROUPS
        self.weights = LoraWeights(shape, config.max_loras, config.max_lora_rank, dtype, device, groups=groups)
        self.hooks = None if fused else LoraHooks(model, self.weights, (nn.Linear, QuantProjection))
        self.slot_writes = 0  # adapters copied into a slot, all steps

    @classmethod
    def of(
        cls, config: EngineConfig, shape: ModelShape, model: Any, dtype: torch.dtype, device: torch.device, *,
        fused: bool,
    ) -> BackendLora | None:  # fmt: skip
        """The slots when the config serves adapters; None (nothing allocated, no hook) when it does not."""
        if not config.lora_enabled:
            return None
        return cls(config, shape, model, dtype, device, fused=fused)

    def write(self, writes: Sequence[tuple[int, object]]) -> None:
        """Copy each (slot, adapter) of a step's plan into its slot, before the forward (the books carry each
        adapter unread: a LoraAdapter, or a TypeError here)."""
        for slot, adapter in writes:
            if not isinstance(adapter, LoraAdapter):
                raise TypeError(f"a plan's LoRA write for slot {slot} holds a {type(adapter).__name__}")
            self.weights.write(slot, adapter)
        self.slot_writes += len(writes)

    def rows(self, entries: Sequence[SeqStep]) -> LoraRows | None:
        """The per-token slots of a packed row of `entries` (in packing order); None when none has an adapter."""
        if all(e.lora_slot == NO_ADAPTER for e in entries):
            return None
        slots: list[int] = []
        for e in entries:
            slots += [e.lora_slot] * len(e.token_ids)
        return LoraRows.of(slots, self.max_loras, device=self.device)

    @contextmanager
    def applied(self, rows: LoraRows | None) -> Iterator[None]:
        """The hooks add `rows`' deltas during the block (the fused forward is handed `rows` instead)."""
        if self.hooks is None or rows is None:
            yield
            return
        self.hooks.rows = rows
        try:
            yield
        finally:
            self.hooks.rows = None
