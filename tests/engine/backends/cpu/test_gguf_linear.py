"""Tests for backends/cpu/gguf_linear.py: q/k/v and gate/up fused over a GGUF's blocks compute what the separate
projections compute, in the Hugging Face row order, whatever mix of block types; the file's pages are released."""

from __future__ import annotations

from pathlib import Path

import torch

from llmserve.engine.backends.cpu import quant
from llmserve.engine.backends.cpu.gguf_linear import fuse
from llmserve.models.gguf_file import GGUFFile
from llmserve.models.gguf_model import build_model
from llmserve.models.loader import from_config
from tests.gguf_helpers import Q, write_llama_gguf
from tests.testing import tiny_config


def tiny_blocks(tmp_path: Path, kinds: dict) -> tuple:  # noqa: ANN401 - (model over blocks, its file)
    config = tiny_config("llama")
    source = from_config(config, dtype=torch.float32, seed=2).model
    file = GGUFFile.open(write_llama_gguf(tmp_path / "tiny.gguf", source, kinds))
    return build_model(file, config), file


def test_fused_qkv_over_mixed_types_equals_the_projections_side_by_side(tmp_path: Path) -> None:
    # q and k in Q4_0, v in Q8_0: one kernel over q and k's rows, another over v's, into one output.
    kinds = {"blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_0}
    model, file = tiny_blocks(tmp_path, kinds)
    attn = model.model.layers[0].self_attn
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    expected = torch.cat([p(x) for p in projections], dim=1)  # each its own kernel, q/k outputs reordered
    fused = fuse(projections, file)
    assert fused.kinds == [quant.GGMLType.Q4_0, quant.GGMLType.Q8_0]
    assert torch.equal(fused(x), expected)
    # A row's result does not depend on the other rows of the call.
    assert torch.equal(fused(x[2:3].contiguous()), expected[2:3])


def test_gate_up_of_one_type_is_one_kernel_and_equals_both(tmp_path: Path) -> None:
    model, file = tiny_blocks(tmp_path, {})
    mlp = model.model.layers[1].mlp
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    fused = fuse([mlp.gate_proj, mlp.up_proj], file)
    assert len(fused.parts) == 1
    assert torch.equal(fused(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=1))


def test_building_releases_the_pages_it_read(tmp_path: Path) -> None:
    model, file = tiny_blocks(tmp_path, {})
    mlp = model.model.layers[0].mlp
    rows = mlp.down_proj.weight_blocks.data
    before = rows.clone()
    fuse([mlp.down_proj], file)  # the kernel packs its own copy; the file's pages leave the mapping
    assert torch.equal(rows, before), "a released page reads the file again"
