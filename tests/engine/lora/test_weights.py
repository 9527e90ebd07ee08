"""The stacked weights: an adapter written into a slot lands in its projections' blocks (scaled, zero-padded), the
fused linears take their projections' columns in order, and clearing or rewriting a slot leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmserve.engine.lora.adapters import read_adapter
from llmserve.engine.lora.ops import LoraRows, add_lora
from llmserve.engine.lora.weights import FUSED_GROUPS, MODULE_GROUPS, LoraWeights
from llmserve.engine.types.model import LoadedModel
from tests.engine.lora.peft_adapters import make_adapter


def test_an_adapter_lands_in_its_slot_scaled_and_padded(tiny: LoadedModel, tmp_path: Path) -> None:
    made = make_adapter(tiny.model, tmp_path / "a", seed=1, merge=False, r=2, lora_alpha=6, target_modules=["k_proj"])
    adapter = read_adapter(made.folder, tiny.shape, 4)
    weights = LoraWeights(tiny.shape, max_loras=2, max_rank=4, dtype=torch.float32)
    weights.write(1, adapter)
    qkv = weights.projection(0, "qkv")
    assert qkv.columns == ((0, 64), (64, 96), (96, 128)) and qkv.targeted == {1}
    module = adapter.modules[0, "k_proj"]
    assert torch.equal(qkv.at[1, :, 4:6], module.a.t())  # k's block: columns [rank, 2 rank), rank 2 of 4 used
    assert torch.equal(qkv.bts[1][1, :2], (module.b * 3.0).t())
    assert not qkv.at[1, :, :4].any() and not qkv.at[1, :, 6:].any() and not qkv.bts[0].any()
    assert not qkv.at[0].any()  # the other slot
    assert weights.projection(1, "gate_up").targeted == set()  # k_proj only
    weights.clear(1)
    assert not any(p.at.any() or any(bt.any() for bt in p.bts) for layer in weights.layers for p in layer.values())
    assert weights.nbytes == sum(
        p.at.nbytes + sum(bt.nbytes for bt in p.bts) for layer in weights.layers for p in layer.values()
    )


def test_fused_and_per_module_layouts_add_the_same_deltas(tiny: LoadedModel, tmp_path: Path) -> None:
    adapter = read_adapter(make_adapter(tiny.model, tmp_path / "a", seed=2, merge=False, r=3).folder, tiny.shape, 4)
    fused = LoraWeights(tiny.shape, 1, 4, torch.float64, groups=FUSED_GROUPS)
    each = LoraWeights(tiny.shape, 1, 4, torch.float64, groups=MODULE_GROUPS)
    fused.write(0, adapter)
    each.write(0, adapter)
    rows = LoraRows.of([0] * 5, 1)
    assert rows is not None
    x = torch.randn(5, 64, dtype=torch.float64)
    for group, names in (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj"))):
        projection = fused.projection(1, group)
        y = torch.zeros(5, projection.columns[-1][1], dtype=torch.float64)
        add_lora(x, y, projection, rows)
        parts = []
        for name in names:
            part_projection = each.projection(1, name)
            part = torch.zeros(5, part_projection.columns[0][1], dtype=torch.float64)
            add_lora(x, part, part_projection, rows)
            parts.append(part)
        torch.testing.assert_close(y, torch.cat(parts, dim=1), rtol=1e-12, atol=1e-12)


def test_an_adapter_of_a_larger_rank_than_the_slots_is_refused(tiny: LoadedModel, tmp_path: Path) -> None:
    adapter = read_adapter(make_adapter(tiny.model, tmp_path / "a", seed=3, merge=False, r=8).folder, tiny.shape, 8)
    weights = LoraWeights(tiny.shape, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="has rank 8, slots hold 4"):
        weights.write(0, adapter)
