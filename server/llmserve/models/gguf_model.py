"""A transformers model whose linears and token embedding compute from a GGUF file's blocks, memory-mapped.

`build_model(file, config)` makes the model's skeleton on torch's meta device (no memory), then gives it what the
file holds: each projection becomes a `QuantProjection` (backends/cpu/gguf_linear.py, beside the kernels it calls)
over the tensor's blocks as the file maps them (quant.py's QuantWeight; nothing is read until a kernel touches it),
the token embedding a `QuantEmbedding` (rows read with pread and decoded on lookup, so that its pages never join the
process's mapping: a tied LM head holds the same blocks packed), the LM head a QuantProjection over `output.weight`
or, tied, over the embedding's own blocks; the norms (F32, a few KB each) are copied into float32 parameters and the
rotary embedding is rebuilt on the CPU. The
skeleton runs transformers' own forward as it is (the torch backend, `generate` in tests); the CPU backend's fused
forward takes the projections' blocks instead (backends/cpu/gguf_linear.py).

llama.cpp's converter permutes the rows of Llama's q and k projections (its rotary pairs neighbouring values, the
Hugging Face layout pairs the two halves of a head); transformers' GGUF loader undoes it on the dequantized
weights. Here the blocks stay as they are and the projection carries the row order that undoes it (`order`): a
row of blocks is a whole output feature, so reordering rows never touches a block.

Served: the Llama family the fused forward serves (GGUF architectures llama, which includes Mistral, qwen2,
qwen3) with tensors of the block types the kernels compute (quant.SUPPORTED). Anything else is refused at start
with a GGUFError that names the file, the tensor and its type, and the way out (`--dtype float32` serves any
file transformers can dequantize).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from llmserve.engine.backends.cpu import quant
from llmserve.engine.backends.cpu.gguf_linear import QuantProjection
from llmserve.models.gguf_file import GGUFError, GGUFFile

# GGUF architectures served from their blocks; "llama" permutes q/k rows (llama.cpp's LlamaModel converter).
ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3"})
PERMUTED = frozenset({"llama"})
_PROJECTIONS = {  # Hugging Face module (parent, name) -> llama.cpp tensor stem
    ("self_attn", "q_proj"): "attn_q",
    ("self_attn", "k_proj"): "attn_k",
    ("self_attn", "v_proj"): "attn_v",
    ("self_attn", "o_proj"): "attn_output",
    ("mlp", "gate_proj"): "ffn_gate",
    ("mlp", "up_proj"): "ffn_up",
    ("mlp", "down_proj"): "ffn_down",
}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_HEAD_NORMS = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}  # Qwen3's per-head norms
DEQUANTIZED_HINT = "serve it dequantized with --dtype float32 (or bfloat16)"


class QuantEmbedding(nn.Module):
    """The token embedding from its blocks: each id's row decoded on lookup, float32. With `file`, the rows are read
    from it with pread (GGUFFile.read_rows) instead of through the mapping: a lookup then leaves no page of the
    embedding in the process's resident set, where a tied LM head already holds the same blocks in its kernel's
    packed copy (the 1B shape's embedding is 210-280 MB: counted twice, it put llmserve's memory over its budget)."""

    def __init__(self, weight: quant.QuantWeight, source: str, file: GGUFFile | None = None) -> None:
        super().__init__()
        self.weight_blocks = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols
        self.source = source
        self.file = file
        self.register_buffer("blocks", weight.data, persistent=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.file is None or ids.numel() == 0:
            rows = quant.dequantize_rows(self.weight_blocks, ids)
        else:
            flat = ids.reshape(-1).long()
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
                raise IndexError(
                    f"row ids must lie in [0, {self.num_embeddings}), got {int(flat.min())}..{int(flat.max())}"
                )
            unique, inverse = torch.unique(flat, return_inverse=True)
            data = self.file.read_rows(self.source, unique.tolist())
            kind, cols = self.weight_blocks.kind, self.weight_blocks.cols
            rows = quant.dequantize(quant.QuantWeight(kind, len(unique), cols, data))[inverse]
        return rows.view(*ids.shape, self.embedding_dim)


def check_servable(file: GGUFFile) -> None:
    """Refuse, naming the file, an architecture or a tensor type this path does not serve (module docstring)."""
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{file.path}: architecture {arch!r} is not served from its blocks (served: "
            f"{', '.join(sorted(ARCHITECTURES))}); {DEQUANTIZED_HINT}"
        )
    supported = {int(k) for k in quant.SUPPORTED}
    for info in file.tensors.values():
        if len(info.dims) == 2 and info.kind not in supported:
            names = ", ".join(k.name for k in sorted(quant.SUPPORTED))
            raise GGUFError(
                f"{file.path}: tensor {info.name} holds {info.type_name} blocks, which llmserve's kernels do not "
                f"compute (they compute {names}); {DEQUANTIZED_HINT}"
            )


def quant_weight(file: GGUFFile, name: str) -> quant.QuantWeight:
    """The 2-D tensor `name` as a QuantWeight over the mapped file."""
    info = file.info(name)
    if len(info.dims) != 2:
        raise GGUFError(f"{file.path}: tensor {name} has {len(info.dims)} dimensions; a weight matrix has 2")
    try:
        return quant.QuantWeight(quant.GGMLType(info.kind), info.rows, info.cols, file.blocks(name))
    except (ValueError, quant.QuantFormatError) as exc:
        raise GGUFError(f"{file.path}: tensor {name}: {exc}") from exc


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Which of llama.cpp's permuted rows is each Hugging Face row of a q or k projection of `heads` heads
    (transformers' reverse_permute_weights, as a row index)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def build_model(file: GGUFFile, config: PretrainedConfig) -> Any:
    """The transformers model of `config` over `file`'s blocks (see the module docstring), in eval mode. Raises
    GGUFError naming the file for what it cannot serve, a tensor it lacks, or a shape that disagrees."""
    check_servable(file)
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32, attn_implementation="sdpa"
        )
    base = model.model
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = int(text.num_attention_heads), int(text.num_key_value_heads or text.num_attention_heads)
    permuted = file.architecture in PERMUTED
    base.embed_tokens = QuantEmbedding(quant_weight(file, "token_embd.weight"), "token_embd.weight", file)
    for i, layer in enumerate(base.layers):
        for (parent, name), stem in _PROJECTIONS.items():
            tensor = f"blk.{i}.{stem}.weight"
            weight = quant_weight(file, tensor)
            bias_name = f"blk.{i}.{stem}.bias"
            bias = file.floats(bias_name) if bias_name in file.tensors else None
            order = None
            if permuted and name in ("q_proj", "k_proj"):
                order = unpermute_order(weight.rows, heads if name == "q_proj" else kv_heads)
                bias = None if bias is None else bias[order]
            _expect(file, tensor, getattr(getattr(layer, parent), name), weight)
            setattr(getattr(layer, parent), name, QuantProjection(weight, bias, order, tensor))
        for name, stem in _NORMS.items():
            _set_norm(getattr(layer, name), file, f"blk.{i}.{stem}.weight")
        for name, stem in _HEAD_NORMS.items():
            module = getattr(layer.self_attn, name, None)
            if module is not None:
                _set_norm(module, file, f"blk.{i}.{stem}.weight")
    _set_norm(base.norm, file, "output_norm.weight")
    head = "output.weight" if "output.weight" in file.tensors else "token_embd.weight"
    model.lm_head = QuantProjection(quant_weight(file, head), None, None, head)
    with torch.device("cpu"):
        base.rotary_emb = type(base.rotary_emb)(config=text)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise GGUFError(f"{file.path}: nothing in the file for {', '.join(left[:5])}")
    model.eval()
    model.requires_grad_(False)
    return model


def _expect(file: GGUFFile, tensor: str, module: nn.Linear, weight: quant.QuantWeight) -> None:
    if (module.out_features, module.in_features) != (weight.rows, weight.cols):
        raise GGUFError(
            f"{file.path}: tensor {tensor} is {weight.rows}x{weight.cols}; the config's model wants "
            f"{module.out_features}x{module.in_features}"
        )


def _set_norm(module: Any, file: GGUFFile, tensor: str) -> None:
    weight = file.floats(tensor)
    expected = tuple(module.weight.shape)
    if tuple(weight.shape) != expected:
        raise GGUFError(f"{file.path}: tensor {tensor} has shape {tuple(weight.shape)}; expected {expected}")
    module.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
