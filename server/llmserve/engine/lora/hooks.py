"""The LoRA deltas on a transformers Llama-family model, by a forward hook on each target projection.

For a forward that runs the model's own modules (the torch_paged backend, and the tests' plain reference), each
q/k/v/o and gate/up/down `nn.Linear` of each layer gets a hook that adds its step's deltas to the linear's
output in place (ops.add_lora over the stacked weights of that projection: weights.MODULE_GROUPS). The owner sets
`rows` before each forward, the rows in the order the model flattens them (batch-major, then tokens); None (the
default, and any step without an adapter row) makes every hook return at once. The state is the owner's object,
not a module global: a second model has its own LoraHooks.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from llmserve.engine.lora.adapters import TARGET_MODULES
from llmserve.engine.lora.ops import LoraRows, add_lora
from llmserve.engine.lora.weights import LoraWeights, StackedProjection


class LoraHooks:
    """Hooks on every target projection of `model` (layers model.model.layers) that add `weights`' deltas for the
    `rows` of the current forward. `remove()` takes them off. `linears`: the module types a projection may be
    (the backend adds a GGUF's, backends/cpu/gguf_linear.QuantProjection); any other is a TypeError."""

    def __init__(self, model: Any, weights: LoraWeights, linears: tuple[type[nn.Module], ...] = (nn.Linear,)) -> None:
        self.rows: LoraRows | None = None
        self._handles = []
        for i, layer in enumerate(model.model.layers[: len(weights.layers)]):
            for name, parent in TARGET_MODULES.items():
                module = getattr(getattr(layer, parent), name)
                if not isinstance(module, linears):
                    raise TypeError(f"layer {i}: {parent}.{name} is a {type(module).__name__}, not a Linear")
                hook = partial(self._add, weights.projection(i, name))
                self._handles.append(module.register_forward_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _add(
        self, projection: StackedProjection, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor
    ) -> torch.Tensor | None:
        rows = self.rows
        if rows is None:
            return None
        x = args[0]
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = output.view(-1, output.shape[-1])
        if flat_y.shape[0] != rows.num_rows:
            raise ValueError(f"the forward has {flat_y.shape[0]} rows, its LoraRows {rows.num_rows}")
        add_lora(flat_x, flat_y, projection, rows)
        return output
