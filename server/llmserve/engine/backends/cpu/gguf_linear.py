"""The linears over a GGUF's blocks (a model from models/gguf_model.build_model, `--dtype gguf`): one projection
(`QuantProjection`, in the transformers model gguf_model builds: its own forward runs it, and LoRA's hooks wrap it),
and the fused forward's (`BlockLinear`, several projections' blocks computed together).

The fused forward runs q/k/v as one linear and gate/up as one. Here their blocks are concatenated row-wise into
one QuantWeight per run of neighbours of the same block type (Q4_K_M files hold q/k in Q4_K and v in Q6_K in half
of the layers: two kernel calls there, each writing its columns of one output), each row taken in the Hugging Face
order (the rows of llama.cpp's permuted q/k picked by the projection's `order`), so that one kernel call computes
what three did: at one sequence a decode step's time is mostly calls, not bytes (SmolLM2: 30 layers). The
concatenation is a transient copy of blocks, never floats: quant.QuantLinear packs its own copy for its kernels
and keeps none of the QuantWeight's bytes, so once a linear is built the file's pages it read are dropped from the
process's mapping (gguf_file.GGUFFile.release) and the resident set counts each weight once.

`BlockLinear` reads float32 rows and gives float32 rows (the float32 precision's row operations run around it),
the bias (Qwen2's q/k/v) added after the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmserve.engine.backends.cpu import quant
from llmserve.engine.types.model import MappedWeights


class QuantProjection(nn.Module):
    """y = x @ W.T (+ bias) from W's blocks (a GGUF tensor as the file holds it), outputs in the Hugging Face
    model's order (`order`: which of the file's rows is each output; None: the file's order).

    The blocks are a buffer (state_dict names them, so that a model fingerprint sees the weights); the kernel
    (quant.QuantLinear) is made on the first call, so that a model served by the fused forward, which builds its
    own from the same blocks, never holds two."""

    def __init__(
        self, weight: quant.QuantWeight, bias: torch.Tensor | None, order: torch.Tensor | None, source: str
    ) -> None:
        super().__init__()
        self.weight_blocks = weight
        self.in_features, self.out_features = weight.cols, weight.rows
        self.order = order
        self.source = source  # the GGUF tensor's name, for messages and for releasing its pages
        self.register_buffer("blocks", weight.data, persistent=True)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._kernel: quant.QuantLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is None:
            self._kernel = quant.QuantLinear(self.weight_blocks)
        flat = x.reshape(-1, self.in_features).float().contiguous()
        y = self._kernel(flat)
        if self.order is not None:
            y = y.index_select(1, self.order)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


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


def fuse(projections: list[QuantProjection], source: MappedWeights | None, activations: str = "int8") -> BlockLinear:
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
