"""The stacked LoRA weights on the device: every slot's factors of each linear in a few tensors.

For each layer and each linear of the forward that applies them (the CPU's fused forward runs q/k/v as one linear
and gate/up as one, FUSED_GROUPS; the transformers path runs each projection alone, MODULE_GROUPS), a
`StackedProjection` holds
- `at` [slots, in, width]: slot s's A factors, transposed, one block of `max_rank` columns per projection of the
  linear (a smaller rank is zero-padded), so that one bmm shrinks a row by its slot for all of them;
- `bts`, one [slots, max_rank, out_i] per projection: its B factors, transposed and multiplied by the module's
  scale (PEFT's lora_alpha / r or its rsLoRA form, adapters.py).
A projection an adapter does not target stays zero in its slot (and a linear that no adapter of a step targets
is skipped: `targeted`). The slots' books are slot_books.SlotBooks; `LoraWeights.write` copies an adapter into the
slot the books chose, before the step that needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from llmserve.engine.lora.adapters import LoraAdapter, LoraModule, projection_shapes
from llmserve.engine.types.model import ModelShape

# The linears of the CPU's fused forward (backends/cpu/fused_layers.py), and of a forward that runs each alone.
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULE_GROUPS: dict[str, tuple[str, ...]] = {
    name: (name,) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
}


@dataclass(slots=True)
class StackedProjection:
    """One linear's LoRA factors for every slot; see the module docstring for the layout."""

    at: torch.Tensor  # [slots, in, width]
    bts: tuple[torch.Tensor, ...]  # per projection of the linear: [slots, rank, out_i]
    rank: int  # columns of `at` per projection per slot (max_rank)
    columns: tuple[tuple[int, int], ...]  # each projection's output columns [start, end) in the linear's output
    targeted: set[int] = field(default_factory=set)  # slots whose adapter targets a projection of this linear

    @classmethod
    def empty(
        cls,
        num_slots: int,
        rank: int,
        fan_in: int,
        fan_outs: tuple[int, ...] | int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> StackedProjection:
        """Zeros for `num_slots` slots of `rank` per projection; `fan_outs`: each projection's output width."""
        outs = (fan_outs,) if isinstance(fan_outs, int) else fan_outs
        starts = [sum(outs[:i]) for i in range(len(outs))]
        at = torch.zeros(num_slots, fan_in, rank * len(outs), dtype=dtype, device=device)
        bts = tuple(torch.zeros(num_slots, rank, n, dtype=dtype, device=device) for n in outs)
        return cls(at, bts, rank, tuple((s, s + n) for s, n in zip(starts, outs, strict=True)))

    def write(self, slot: int, modules: list[LoraModule | None]) -> None:
        """Fill `slot` with one module per projection of the linear (None: not targeted, zeros)."""
        if len(modules) != len(self.columns):
            raise ValueError(f"{len(modules)} modules for a linear of {len(self.columns)} projections")
        self.clear(slot)
        for i, module in enumerate(modules):
            if module is None:
                continue
            if module.rank > self.rank:
                raise ValueError(f"rank {module.rank} does not fit a slot of rank {self.rank}")
            self.at[slot, :, i * self.rank : i * self.rank + module.rank].copy_(module.a.t())
            self.bts[i][slot, : module.rank].copy_((module.b * module.scale).t())
            self.targeted.add(slot)

    def clear(self, slot: int) -> None:
        self.at[slot].zero_()
        for bt in self.bts:
            bt[slot].zero_()
        self.targeted.discard(slot)


class LoraWeights:
    """Every layer's stacked linears for `max_loras` slots of rank `max_rank`, in `dtype` on `device`.

    `groups` names the linears of the forward that applies them (FUSED_GROUPS or MODULE_GROUPS)."""

    def __init__(
        self,
        shape: ModelShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        groups: Mapping[str, tuple[str, ...]] = FUSED_GROUPS,
    ) -> None:
        shapes = projection_shapes(shape)
        self.groups = dict(groups)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers: list[dict[str, StackedProjection]] = []
        for _ in range(shape.num_layers):
            layer = {}
            for group, names in self.groups.items():
                fan_ins = {shapes[n][0] for n in names}
                if len(fan_ins) != 1:
                    raise ValueError(f"group {group}: its projections read inputs of different widths")
                outs = tuple(shapes[n][1] for n in names)
                layer[group] = StackedProjection.empty(max_loras, max_rank, fan_ins.pop(), outs, dtype, device)
            self.layers.append(layer)

    def projection(self, layer: int, group: str) -> StackedProjection:
        return self.layers[layer][group]

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy the adapter's factors into `slot` (every layer; projections it does not target become zeros)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.path} has rank {adapter.rank}, slots hold {self.max_rank}")
        for i, layer in enumerate(self.layers):
            for group, names in self.groups.items():
                layer[group].write(slot, [adapter.modules.get((i, name)) for name in names])

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for projection in layer.values():
                projection.clear(slot)

    @property
    def nbytes(self) -> int:
        return sum(p.at.nbytes + sum(bt.nbytes for bt in p.bts) for layer in self.layers for p in layer.values())
