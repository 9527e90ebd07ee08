"""A fused forward for Llama-family models on the CPU: fewer, larger operations per layer.

transformers' decoder layer runs about forty torch operations and ten module calls per layer. At the row
counts of a decode step (one per sequence) their dispatch costs more than their arithmetic: on SmolLM2-135M
with 32 sequences, about 35 ms of a 168 ms step went to neither the linears nor attention. This forward
computes the same layer with
- the q/k/v projections as one linear and gate/up as one (concatenated weights, packed for oneDNN where
  packed_linear applies);
- RMSNorm, the residual add folded into the next RMSNorm, rotary embedding and SiLU-and-multiply as single
  passes (csrc/fused_ops.c through native.FusedOps);
- the backend's paged attention, called directly;
- with LoRA rows, each linear's batched adapter deltas (lora/ops.add_lora) added to its output in place.

It serves Llama, Mistral, Qwen2 and Qwen3 checkpoints (SiLU MLP, RMSNorm, rotary embedding computed by the
model's own rotary module, so every rope scaling type works), float32 or float64, on the CPU. `build`
returns None for anything else and the backend calls the model's own forward. The model itself is left as
it is: `generate` on it still runs transformers' code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from llmserve.engine.backends.cpu import native, packed_linear
from llmserve.engine.lora.ops import LoraRows, add_lora
from llmserve.engine.lora.weights import LoraWeights
from llmserve.model_shape import ModelShape

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# attention.paged_attention: (module, query [1, H, T, D], key, value [1, KVH, T, D], mask, scaling=, llmserve_batch=)
Attention = Callable[..., tuple[torch.Tensor, None]]
SILU_TYPES = (nn.SiLU, SiLUActivation)


@dataclass(slots=True)
class FusedLinear:
    """One linear over concatenated weights: packed for oneDNN, or plain for F.linear."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: bool

    @classmethod
    def of(cls, linears: list[nn.Linear], pack: bool) -> FusedLinear:
        weight = torch.cat([m.weight.detach() for m in linears]).contiguous()
        bias = None
        if any(m.bias is not None for m in linears):
            parts = [m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in linears]
            bias = torch.cat(parts)
        if pack:
            return cls(packed_linear.pack_weight(weight, 64), bias, True)
        return cls(weight, bias, False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return packed_linear.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class FusedLayer:
    attn: Any  # the model's attention module: paged_attention reads its layer_idx
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: FusedLinear
    o: FusedLinear
    gate_up: FusedLinear
    down: FusedLinear
    q_norm: tuple[torch.Tensor, float] | None  # Qwen3's per-head norms, before rotary
    k_norm: tuple[torch.Tensor, float] | None
    scaling: float


def _norm(module: Any) -> tuple[torch.Tensor, float]:
    return module.weight.detach().contiguous(), float(module.variance_epsilon)


def _fits(layer: Any) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    norms += [m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None]
    return (
        all(type(m) is nn.Linear for m in linears)
        and all(hasattr(m, "weight") and hasattr(m, "variance_epsilon") for m in norms)
        and isinstance(getattr(mlp, "act_fn", None), SILU_TYPES)
        and hasattr(attn, "scaling")
        and hasattr(attn, "layer_idx")
    )


class FusedForward:
    """The model's forward over one packed row of tokens, fused; see the module docstring."""

    def __init__(self, model: Any, shape: ModelShape, ops: native.FusedOps, pack: bool, attention: Attention) -> None:
        base = model.model
        self.ops = ops
        self.attention = attention
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.final_norm = _norm(base.norm)
        self.lm_head = FusedLinear.of([model.get_output_embeddings()], pack)
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.layers = [self._layer(layer, pack) for layer in base.layers[: shape.num_layers]]
        self.num_packed = (4 * len(self.layers) + 1) if pack else 0

    @classmethod
    def build(
        cls, model: Any, ops: native.FusedOps | None, pack: bool, attention: Attention, shape: ModelShape | None = None
    ) -> FusedForward | None:
        """The fused forward of `model`, or None where it does not apply (another architecture, a device other
        than the CPU, a dtype the kernels lack, or no compiled kernels). `pack`: run the linears on packed oneDNN
        weights (float32 only); `attention`: the backend's paged attention function; `shape`: the model's
        (LoadedModel.shape), read from its config when not given."""
        param = next(model.parameters())
        config = model.config
        if ops is None or param.device.type != "cpu" or param.dtype not in ops.dtypes:
            return None
        if (
            getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES
            or getattr(config, "hidden_act", None) != "silu"
        ):
            return None
        base: Any = getattr(model, "model", None)
        if not all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return None
        if not all(_fits(layer) for layer in base.layers):
            return None
        return cls(model, shape or ModelShape.of(config), ops, pack, attention)

    def _layer(self, layer: Any, pack: bool) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return FusedLayer(
            attn,
            *_norm(layer.input_layernorm),
            *_norm(layer.post_attention_layernorm),
            qkv=FusedLinear.of([attn.q_proj, attn.k_proj, attn.v_proj], pack),
            o=FusedLinear.of([attn.o_proj], pack),
            gate_up=FusedLinear.of([mlp.gate_proj, mlp.up_proj], pack),
            down=FusedLinear.of([mlp.down_proj], pack),
            q_norm=None if q_norm is None else _norm(q_norm),
            k_norm=None if k_norm is None else _norm(k_norm),
            scaling=float(attn.scaling),
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None,
        batch: object,
        lora: LoraRows | None = None,
        lora_weights: LoraWeights | None = None,
    ) -> torch.Tensor:
        """input_ids/position_ids [1, tokens]; logits of the `keep` rows (all when None) as float32. `lora`: each
        row's adapter slot, whose deltas (`lora_weights`, FUSED_GROUPS) are added to each linear's output before
        the next fused pass reads it."""
        slots = None if lora is None or lora_weights is None else lora_weights.layers
        ops = self.ops
        tokens = input_ids.shape[1]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * dim, kv_heads * dim
        residual = self.embed(input_ids[0])  # a fresh tensor: the residual stream is added to in place
        cos, sin = self.rotary(residual[None], position_ids)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        x = ops.rms_norm(residual, self.layers[0].input_norm, self.layers[0].input_eps)
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if delta is not None:
                x = ops.add_rms_norm(residual, delta, layer.input_norm, layer.input_eps)
            qkv = layer.qkv(x)
            if slots is not None:
                add_lora(x, qkv, slots[i]["qkv"], lora)  # type: ignore[arg-type]
            q = qkv[:, :q_width].view(tokens, heads, dim)
            k = qkv[:, q_width : q_width + kv_width].view(tokens, kv_heads, dim)
            v = qkv[:, q_width + kv_width :].view(tokens, kv_heads, dim)
            if layer.q_norm is not None:
                q = ops.rms_norm(q.reshape(-1, dim), *layer.q_norm).view(tokens, heads, dim)
            if layer.k_norm is not None:
                k = ops.rms_norm(k.reshape(-1, dim), *layer.k_norm).view(tokens, kv_heads, dim)
            ops.rotary(q, cos, sin)
            ops.rotary(k, cos, sin)
            attended, _ = self.attention(
                layer.attn,
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                None,
                scaling=layer.scaling,
                llmserve_batch=batch,
            )
            attended = attended.view(tokens, q_width)
            out = layer.o(attended)
            if slots is not None:
                add_lora(attended, out, slots[i]["o"], lora)  # type: ignore[arg-type]
            x = ops.add_rms_norm(residual, out, layer.post_norm, layer.post_eps)
            gate_up = layer.gate_up(x)
            if slots is not None:
                add_lora(x, gate_up, slots[i]["gate_up"], lora)  # type: ignore[arg-type]
            inner = ops.silu_mul(gate_up)
            delta = layer.down(inner)
            if slots is not None:
                add_lora(inner, delta, slots[i]["down"], lora)  # type: ignore[arg-type]
        assert delta is not None  # a model has at least one layer
        rows = residual if keep is None else residual.index_select(0, keep)
        last = delta if keep is None else delta.index_select(0, keep)
        x = ops.add_rms_norm(rows.contiguous(), last, *self.final_norm)
        return self.lm_head(x).float()
