"""The fused forward's linears over a GGUF's blocks (a model from gguf_model.build_model, `--dtype gguf`).

The fused forward runs q/k/v as one linear and gate/up as one. Here their blocks are concatenated row-wise into
one QuantWeight per run of neighbours of the same block type (Q4_K_M files hold q/k in Q4_K and v in Q6_K in half
of the layers: two kernel calls there, each writing its columns of one output), each row taken in the Hugging Face
order (the rows of llama.cpp's permuted q/k picked by the projection's `order`), so that one kernel call computes
what three did: at one sequence a decode step's time is mostly calls, not bytes (SmolLM2: 30 layers). The
concatenation is a transient copy of blocks, never floats: quant.QuantLinear packs its own copy for its kernels
and keeps none of the QuantWeight's bytes, so once a linear is built the file's pages it read are dropped from the
process's mapping (GGUFFile.release) and the resident set counts each weight once.

`BlockLinear` reads float32 rows and gives float32 rows (the float32 precision's row operations run around it),
the bias (Qwen2's q/k/v) added after the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.engine.backends.cpu import quant
from llmserve.gguf_file import GGUFFile
from llmserve.gguf_model import QuantProjection


@dataclass(slots=True)
class BlockLinear:
    """One fused-forward linear over blocks: `parts` computed on the same rows, their outputs side by side;
    `kinds` their block types."""

    parts: list[quant.QuantLinear]
    kinds: list[quant.GGMLType]
    bias: torch.Tensor | None
    takes: torch.dtype = torch.float32
    gives: torch.dtype = torch.float32
    packed: bool = False

    @property
    def nbytes(self) -> int:
        """What the kernels hold."""
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: object) -> torch.Tensor:
        assert isinstance(x, torch.Tensor)
        if len(self.parts) == 1:
            out = self.parts[0](x)
        else:
            out = torch.empty(x.shape[0], sum(p.out_features for p in self.parts), dtype=torch.float32)
            start = 0
            for part in self.parts:
                part(x, out=out[:, start : start + part.out_features])
                start += part.out_features
        if self.bias is not None:
            out += self.bias
        return out


def fuse(projections: list[QuantProjection], source: GGUFFile | None, activations: str = "int8") -> BlockLinear:
    """One linear over `projections` (outputs in their order, each in the Hugging Face row order), its kernels'
    copies made, taking `activations` as quant.QuantLinear does; then `source`'s pages of every projection are
    released (see the module docstring)."""
    runs: list[list[QuantProjection]] = []
    for p in projections:
        if runs and runs[-1][0].weight_blocks.kind == p.weight_blocks.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    parts, kinds = [], []
    for run in runs:
        weight = _concatenated(run)
        parts.append(quant.QuantLinear(weight, activations=activations))
        kinds.append(weight.kind)
        del weight  # the transient concatenation, before the next run's
    if source is not None:
        source.release([p.source for p in projections])
    bias = None
    if any(p.bias is not None for p in projections):
        bias = torch.cat([p.bias.detach() if p.bias is not None else torch.zeros(p.out_features) for p in projections])
    return BlockLinear(parts, kinds, bias)


def _concatenated(run: list[QuantProjection]) -> quant.QuantWeight:
    first = run[0].weight_blocks
    if len(run) == 1 and run[0].order is None:
        return first
    data = torch.empty(sum(p.out_features for p in run), first.data.shape[1], dtype=torch.uint8)
    start = 0
    for p in run:
        rows = data[start : start + p.out_features]
        if p.order is None:
            rows.copy_(p.weight_blocks.data)
        else:
            torch.index_select(p.weight_blocks.data, 0, p.order, out=rows)
        start += p.out_features
    return quant.QuantWeight(first.kind, data.shape[0], first.cols, data)
