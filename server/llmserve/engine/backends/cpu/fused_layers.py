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
- with LoRA rows, each linear's batched adapter deltas (lora/ops.add_lora) added to its output in place (the
  float32/float64 precision only: the CPU backend refuses LoRA beside bfloat16 or int8, cpu/backend.py).

It serves Llama, Mistral, Qwen2 and Qwen3 checkpoints (SiLU MLP, RMSNorm, rotary embedding computed by the
model's own rotary module, so every rope scaling type works) on the CPU, in one of three precisions (`Precision`):
- float32 (and float64): every row in the model's dtype, the linears packed (float32) or plain; the exact path;
- bfloat16 (a bfloat16 model): the linears in bfloat16 with float32 accumulation (packed_linear.PackedBF16);
  q/k/v, the attention and the MLP's rows in bfloat16 (the KV cache too), while the residual stream, the norms'
  arithmetic, rotary, SiLU and the logits stay float32 (csrc/mixed_ops.c through native.MixedOps);
- int8 (a bfloat16 model, `weights="int8"`): as bfloat16, with int8 weights and each input row quantized to int8
  with its own scale (packed_linear.Int8Linear); the norms and SiLU write the quantized rows directly;
- gguf (a model over a GGUF's blocks, models/gguf_model.py, `weights="gguf"`): float32 rows, residual and KV cache as
  float32's, every linear, the LM head included, computed from the file's blocks (gguf_linear.BlockLinear over
  quant.QuantLinear, whose kernels quantize each input row per block of 32 as llama.cpp does), the token
  embedding decoded row by row (quant.dequantize_rows); gguf-float32 (`--gguf-activations float32`) the same with
  the kernels' float32 activations: the float32 path's arithmetic up to float32 rounding.
`build` returns None for anything else and the backend calls the model's own forward. The model itself is left
as it is: `generate` on it still runs transformers' code.

Every operation here computes a row from that row alone, with the same code at any row count (the bfloat16
linears split long reductions for this, packed_linear.py), and the backend's attention gives a token the same
result in a prompt chunk as in a decode step (metadata.KernelDecodeBuilder, `every_token`): a request's tokens
do not depend on what else is batched with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.activations import SiLUActivation

from llmserve.engine.backends.cpu import gguf_linear, native
from llmserve.engine.backends.cpu.gguf_linear import QuantProjection
from llmserve.engine.backends.cpu.packed_linear import (
    Linear,
    RefinedHead,
    bf16_available,
    make_linear,
    onednn_implementation,
    sample_input,
)
from llmserve.engine.lora.ops import LoraRows, add_lora
from llmserve.engine.lora.weights import LoraWeights
from llmserve.engine.types.model import MappedWeights, ModelShape

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# attention.paged_attention: (module, query [1, H, T, D], key, value [1, KVH, T, D], mask, scaling=, llmserve_batch=)
Attention = Callable[..., tuple[torch.Tensor, None]]
SILU_TYPES = (nn.SiLU, SiLUActivation)
WEIGHTS = ("float32", "bfloat16", "int8", "gguf")


@dataclass(slots=True, frozen=True)
class Precision:
    """How the fused forward computes (see the module docstring): `linears` and `head` are packed_linear KINDS or
    "gguf"; `rows` is the dtype of q/k/v, the attention and the KV cache (the model's); `residual` the residual
    stream's."""

    linears: str
    head: str
    rows: torch.dtype
    residual: torch.dtype

    @classmethod
    def of(cls, dtype: torch.dtype, weights: str | None = None) -> Precision | None:
        """The precision of a model of `dtype` (`weights`: "int8" for int8 linears on a bfloat16 model, "gguf" for a
        float32 model over a GGUF's blocks); None
        where the fused forward has none."""
        if dtype == torch.float32 and weights in ("gguf", "gguf-float32"):
            return cls(weights, weights, dtype, dtype)
        if dtype in (torch.float32, torch.float64) and weights in (None, "float32"):
            return cls("float32", "float32", dtype, dtype)
        if dtype == torch.bfloat16 and weights in (None, "bfloat16"):
            return cls("bfloat16", "bfloat16", dtype, torch.float32)
        if dtype == torch.bfloat16 and weights == "int8":
            return cls("int8", "int8", dtype, torch.float32)
        return None

    @property
    def exact(self) -> bool:
        """The linears take their input rows as they are (float32/float64, or a GGUF's blocks with float32
        activations): every row in the model's dtype, through csrc/fused_ops.c, prompts attended as float32's are;
        "gguf" kernels quantize their inputs per block of 32 (quant.py)."""
        return self.linears in ("float32", "gguf-float32")

    @property
    def every_token(self) -> bool:
        """Every token attends through the decode kernel, prompt chunks' too (metadata.KernelDecodeBuilder), so that
        a token's result does not depend on the chunk or step that computed it: all but the dense float32/float64
        linears, which attend prompts as transformers does (SDPA) and so equal its `generate` exactly. A GGUF's
        blocks with float activations keep the float32 path's greedy tokens either way (float32 rounding in
        another order), and become batch-invariant bit for bit."""
        return self.linears not in ("float32",)

    @property
    def float_rows(self) -> bool:
        """Every row in the model's dtype (float32 or float64) through csrc/fused_ops.c: the exact precision and
        a GGUF's blocks, whose linears read and give float32 rows; LoRA deltas add to such rows."""
        return self.rows in (torch.float32, torch.float64)


@dataclass(slots=True)
class FusedLayer:
    attn: Any  # the model's attention module: paged_attention reads its layer_idx
    input_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: tuple[torch.Tensor, float] | None  # Qwen3's per-head norms, before rotary
    k_norm: tuple[torch.Tensor, float] | None
    scaling: float


class ExactRows:
    """The layer's elementwise passes for float32/float64 rows (csrc/fused_ops.c): every row in one dtype."""

    def __init__(self, ops: native.FusedOps) -> None:
        self.ops = ops

    def norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float], out: torch.dtype) -> native.Rows:
        return self.ops.rms_norm(x, *norm)

    def add_norm(
        self, residual: torch.Tensor, x: torch.Tensor, norm: tuple[torch.Tensor, float], out: torch.dtype
    ) -> native.Rows:
        return self.ops.add_rms_norm(residual, x, *norm)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.ops.rotary(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.dtype) -> native.Rows:
        return self.ops.silu_mul(gate_up)

    def convert(self, x: torch.Tensor, out: torch.dtype) -> native.Rows:
        return x


class MixedRows:
    """The same passes over bfloat16 rows and a float32 residual (csrc/mixed_ops.c), each writing the format the
    next linear reads."""

    def __init__(self, ops: native.MixedOps) -> None:
        self.ops = ops

    def norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float], out: torch.dtype) -> native.Rows:
        return self.ops.rms_norm(x, norm[0], norm[1], out)

    def add_norm(
        self, residual: torch.Tensor, x: torch.Tensor, norm: tuple[torch.Tensor, float], out: torch.dtype
    ) -> native.Rows:
        return self.ops.add_rms_norm(residual, x, norm[0], norm[1], out)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.ops.rotary(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.dtype) -> native.Rows:
        return self.ops.silu_mul(gate_up, out)

    def convert(self, x: torch.Tensor, out: torch.dtype) -> native.Rows:
        return x if x.dtype == out else self.ops.convert(x, out)


RowOps = ExactRows | MixedRows


def _norm(module: Any, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    return module.weight.detach().to(dtype).contiguous(), float(module.variance_epsilon)


def _linear(
    linears: list[Any],
    kind: str,
    pack: bool,
    ops: native.MixedOps | None,
    gives: torch.dtype,
    source: MappedWeights | None,
) -> Linear:
    """One linear over the concatenated weights (and biases) of `linears` (nn.Linear, or QuantProjection for "gguf";
    `source` the file their blocks are mapped from)."""
    if kind in ("gguf", "gguf-float32"):
        return gguf_linear.fuse(linears, source, "float32" if kind == "gguf-float32" else "int8")
    weight = torch.cat([m.weight.detach() for m in linears]).contiguous()
    bias = None
    if any(m.bias is not None for m in linears):
        parts = [m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in linears]
        bias = torch.cat(parts)
    return make_linear(weight, bias, kind, pack, ops, gives)


def _fits(layer: Any, linear: type[nn.Module]) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    norms += [m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None]
    return (
        all(type(m) is linear for m in linears)
        and all(hasattr(m, "weight") and hasattr(m, "variance_epsilon") for m in norms)
        and isinstance(getattr(mlp, "act_fn", None), SILU_TYPES)
        and hasattr(attn, "scaling")
        and hasattr(attn, "layer_idx")
    )


class FusedForward:
    """The model's forward over one packed row of tokens, fused; see the module docstring."""

    def __init__(
        self,
        model: Any,
        shape: ModelShape,
        precision: Precision,
        rows: RowOps,
        mixed: native.MixedOps | None,
        pack: bool,
        attention: Attention,
        source: MappedWeights | None = None,
        generates: bool = True,
    ) -> None:
        base = model.model
        self.source = source
        self.precision = precision
        self.ops = rows
        self.attention = attention
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        p = precision
        norm_dtype = p.residual
        self.final_norm = _norm(base.norm, norm_dtype)
        # A model that does not generate (a classifier: its own head reads the final hidden state) gets no LM head:
        # nothing samples, and a packed copy of a vocabulary-sized weight would be memory for nothing.
        self.lm_head: Linear | None = None
        if generates:
            head = model.get_output_embeddings()
            self.lm_head = _linear([head], p.head, pack, mixed, torch.float32, source)
            if not p.float_rows and mixed is not None:
                self.lm_head = RefinedHead(self.lm_head, head.weight.detach(), mixed)
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.layers = [self._layer(layer, pack, mixed) for layer in base.layers[: shape.num_layers]]
        self.num_packed = sum(lin.packed for lin in self.linears())

    @classmethod
    def build(
        cls,
        model: Any,
        ops: native.FusedOps | None,
        pack: bool,
        attention: Attention,
        shape: ModelShape | None = None,
        *,
        mixed: native.MixedOps | None = None,
        weights: str | None = None,
        source: MappedWeights | None = None,
        generates: bool = True,
    ) -> FusedForward | None:
        """The fused forward of `model`, or None where it does not apply (another architecture, a device other
        than the CPU, a dtype without a Precision, no compiled kernels, or bfloat16 rows oneDNN cannot run on this
        CPU: below AVX-512, a bfloat16 model runs transformers' layers). `pack`: run float32 linears on packed
        oneDNN weights; `attention`: the backend's paged attention function; `shape`: the model's
        (LoadedModel.shape), read from its config when not given; `mixed`: the row operations a bfloat16 or int8
        precision needs; `weights`: "int8" for int8 linears on a bfloat16 model, "gguf" for a model over a GGUF's
        blocks (gguf_model.build_model; `source`: the file, whose pages of copied blocks are released), its kernels
        quantizing activations per block, or "gguf-float32" with float32 activations. `generates`: False for a
        model that never samples (a classifier), which gets no LM head."""
        param = next(model.parameters())
        config = model.config
        precision = Precision.of(param.dtype, weights)
        if ops is None or param.device.type != "cpu" or precision is None:
            return None
        if not precision.float_rows and (mixed is None or not bf16_available()):
            return None
        if (
            getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES
            or getattr(config, "hidden_act", None) != "silu"
        ):
            return None
        base: Any = getattr(model, "model", None)
        if not all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return None
        linear = QuantProjection if precision.linears.startswith("gguf") else nn.Linear
        if not all(_fits(layer, linear) for layer in base.layers):
            return None
        rows: RowOps = ExactRows(ops) if precision.float_rows or mixed is None else MixedRows(mixed)
        return cls(model, shape or ModelShape.of(config), precision, rows, mixed, pack, attention, source, generates)

    def _layer(self, layer: Any, pack: bool, mixed: native.MixedOps | None) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        p = self.precision
        kind, norms = p.linears, p.residual
        return FusedLayer(
            attn,
            _norm(layer.input_layernorm, norms),
            _norm(layer.post_attention_layernorm, norms),
            # int8: q/k/v come out in the rows' dtype (rotary, the cache), o and down float32 (the residual's).
            qkv=_linear([attn.q_proj, attn.k_proj, attn.v_proj], kind, pack, mixed, p.rows, self.source),
            o=_linear([attn.o_proj], kind, pack, mixed, torch.float32, self.source),
            gate_up=_linear([mlp.gate_proj, mlp.up_proj], kind, pack, mixed, torch.float32, self.source),
            down=_linear([mlp.down_proj], kind, pack, mixed, torch.float32, self.source),
            q_norm=None if q_norm is None else _norm(q_norm, norms),
            k_norm=None if k_norm is None else _norm(k_norm, norms),
            scaling=float(attn.scaling),
        )

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None,
        batch: object,
        lora: LoraRows | None = None,
        lora_weights: LoraWeights | None = None,
        pool: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids/position_ids [1, tokens]; (logits of the `keep` rows, all when None, as float32; with `pool` the
        final hidden states of those rows, after the final norm, float32, else None). `lora`: each row's adapter
        slot, whose deltas (`lora_weights`, FUSED_GROUPS) are added to each linear's output before the next fused
        pass reads it."""
        slots = None if lora is None or lora_weights is None else lora_weights.layers
        ops = self.ops
        tokens = input_ids.shape[1]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * dim, kv_heads * dim
        residual, cos, sin = self.inputs(input_ids, position_ids)
        first = self.layers[0]
        x = ops.norm(residual, first.input_norm, first.qkv.takes)
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if delta is not None:
                x = ops.add_norm(residual, delta, layer.input_norm, layer.qkv.takes)
            qkv = layer.qkv(x)
            if slots is not None:
                add_lora(x, qkv, slots[i]["qkv"], lora)  # type: ignore[arg-type]
            q = qkv[:, :q_width].view(tokens, heads, dim)
            k = qkv[:, q_width : q_width + kv_width].view(tokens, kv_heads, dim)
            v = qkv[:, q_width + kv_width :].view(tokens, kv_heads, dim)
            if layer.q_norm is not None:
                q = self._head_norm(q, layer.q_norm)
            if layer.k_norm is not None:
                k = self._head_norm(k, layer.k_norm)
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
            o_in = ops.convert(attended.view(tokens, q_width), layer.o.takes)
            o = layer.o(o_in)
            if slots is not None:
                add_lora(o_in, o, slots[i]["o"], lora)  # type: ignore[arg-type]
            x = ops.add_norm(residual, o, layer.post_norm, layer.gate_up.takes)
            gate_up = layer.gate_up(x)
            if slots is not None:
                add_lora(x, gate_up, slots[i]["gate_up"], lora)  # type: ignore[arg-type]
            inner = ops.silu_mul(gate_up, layer.down.takes)
            delta = layer.down(inner)
            if slots is not None:
                add_lora(inner, delta, slots[i]["down"], lora)  # type: ignore[arg-type]
        assert delta is not None  # a model has at least one layer
        hidden = None
        if pool is not None and not pool.numel():
            hidden = residual.new_zeros((0, residual.shape[1]), dtype=torch.float32)
        elif pool is not None:  # from copies of the rows, before the LM head's pass adds to the residual in place
            normed = ops.add_norm(
                residual.index_select(0, pool).contiguous(), delta.index_select(0, pool), self.final_norm, torch.float32
            )
            assert isinstance(normed, torch.Tensor)
            hidden = normed.float()
        if keep is not None and not keep.numel():  # a step of pooling requests alone: no row samples
            return residual.new_zeros((0, 1), dtype=torch.float32), hidden
        rows = residual if keep is None else residual.index_select(0, keep)
        last = delta if keep is None else delta.index_select(0, keep)
        if self.lm_head is None:
            raise ValueError("this model has no LM head (it does not generate): no row can sample")
        x = ops.add_norm(rows.contiguous(), last, self.final_norm, self.lm_head.takes)
        return self.lm_head(x).float(), hidden

    def inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A step's residual stream (a fresh tensor, the embedding's rows in the residual's dtype: it is added to in
        place) and its rotary cos and sin [tokens, head dim], contiguous."""
        residual = self.embed(input_ids[0]).to(self.precision.residual)
        cos, sin = self.rotary(residual[None], position_ids)
        return residual, cos[0].contiguous(), sin[0].contiguous()

    @property
    def activations(self) -> str:
        """How the GGUF block kernels take their rows: "float32" or "int8" (meaningful for the gguf precisions)."""
        return "float32" if self.precision.linears == "gguf-float32" else "int8"

    def linears(self) -> list[Linear]:
        """Every linear of the forward: the LM head (where there is one), then each layer's four."""
        head = [] if self.lm_head is None else [self.lm_head]
        return head + [lin for ly in self.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)]

    def onednn_kernel(self) -> str | None:
        """The oneDNN kernel the MLP's gate/up linear runs (its instruction set included), or None where none does."""
        layer = self.layers[0]
        x = sample_input(layer.gate_up, layer.input_norm[0].shape[0])
        with torch.inference_mode():
            return onednn_implementation(lambda: layer.gate_up(x))

    def _head_norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        tokens, heads, dim = x.shape
        out = self.ops.norm(x.reshape(-1, dim), norm, x.dtype)
        assert isinstance(out, torch.Tensor)
        return out.view(tokens, heads, dim)
