"""A BERT-family encoder's forward over a batch of sequences of different lengths: bidirectional attention, no KV
cache, every token's final hidden state out (pooling.py makes vectors of them).

Layout: the sequences' tokens are packed one after another ([tokens, hidden], `EncoderBatch`), so the linears,
the layer norms and the embeddings never compute a padding row. Attention alone scatters the packed queries, keys
and values into a [sequences, heads, longest, head_dim] block and runs torch's scaled_dot_product_attention with a
key mask, then gathers the real rows back; it does so per group of consecutive sequences of like length
(`AttentionGroup`, each padded to its own longest), so that a step's short sentences are not padded to its longest
one. Measured against the alternatives (benchmarks/probes/encoder_forward.py:
all-MiniLM-L6-v2, float32, the first sentences of tests/data/sentences.txt, median of 11 alternated repetitions, on
the shared 2-core development machine under heavy load from other jobs, so the absolute times are inflated and only
the ratios indicate), in ms for 8 / 32 / 128 sentences (221 / 1,033 / 4,221 tokens; 280 / 2,112 / 8,448 padded):

    packed rows, padded attention, oneDNN-packed linears   1,015 /  3,982 /  4,954   (this module)
    the same with F.linear                                  1,183 /  4,222 /  6,962
    packed rows, one SDPA call per sequence                 1,570 / 13,131 / 21,205
    transformers' BertModel on the padded batch (sdpa)      1,423 /  7,577 / 10,705

A second run, 40 minutes later under less load, gave at 32 sentences 1,806 / 2,422 / 6,870 / 3,266 ms in the same
order. Every variant's hidden states are within 7.3e-6 of transformers'. A call per sequence loses to its call overhead
(6 layers x sequences calls); padding every row (transformers) computes 1.3-2x the tokens in every linear.

The linears are the CPU backend's: float32 weights packed once for oneDNN (packed_linear.py) where this torch build
has it, else F.linear; or, with `matmul` bf16x3 (`--fp32-matmul`, auto where the CPU has AMX), each as three
bfloat16 products on AMX tiles (split_linear.py: within ~4e-6 of float32's, about twice as fast), which also adds
the residual of the attention output and of the MLP as it writes. Weights are read from a transformers state dict
(`BertModel`, or the `bert.` prefix of `BertForSequenceClassification`) by name; RoBERTa's learned positions start
after its padding index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from llmserve.engine.backends.cpu import packed_linear
from llmserve.engine.backends.cpu.split_linear import Fp32Matmul, SplitLinear
from llmserve.engine.backends.encoder_batch import EncoderBatch

__all__ = ["BertEncoder", "EncoderConfig"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # BERT's: the exact (erf) form
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert"})


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """The dimensions of a BERT-family encoder, from its config.json."""

    hidden_size: int
    num_heads: int
    num_layers: int
    intermediate_size: int
    max_positions: int
    layer_norm_eps: float
    activation: str
    position_offset: int  # RoBERTa's positions start at padding_idx + 1; BERT's at 0

    @classmethod
    def of(cls, config: Mapping[str, Any] | Any) -> EncoderConfig:
        """From config.json's contents or a transformers PretrainedConfig. ValueError for what is not served."""
        values: dict[str, Any] = dict(config) if isinstance(config, Mapping) else config.to_dict()
        get = values.get

        def need(key: str) -> int:
            if values.get(key) is None:
                raise ValueError(f"the config has no {key}")
            return int(values[key])

        model_type = str(get("model_type", ""))
        if model_type not in ENCODER_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a served encoder ({', '.join(sorted(ENCODER_TYPES))})")
        activation = str(get("hidden_act", "gelu"))
        if activation not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {activation!r} is not served ({', '.join(sorted(_ACTIVATIONS))})")
        if str(get("position_embedding_type", "absolute") or "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are served")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        roberta = model_type != "bert"
        pad = get("pad_token_id", 1)
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_layers=need("num_hidden_layers"),
            intermediate_size=need("intermediate_size"),
            max_positions=need("max_position_embeddings") - ((int(pad) + 1) if roberta else 0),
            layer_norm_eps=float(get("layer_norm_eps", 1e-12)),
            activation=activation,
            position_offset=(int(pad) + 1) if roberta else 0,
        )


class Linear(Protocol):
    """x @ weight.T + bias, plus `residual` where given (the split linear adds it as it writes its output)."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(slots=True)
class _Layer:
    qkv: Linear  # query, key and value in one [3 * hidden, hidden] weight
    out: Linear
    norm1: tuple[torch.Tensor, torch.Tensor]
    up: Linear
    down: Linear
    norm2: tuple[torch.Tensor, torch.Tensor]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, matmul: Fp32Matmul) -> Linear:
    if matmul is Fp32Matmul.BF16X3:
        return SplitLinear(weight, bias)
    if pack:
        packed = packed_linear.pack_weight(weight.contiguous())
        return lambda x, residual=None: _plus(packed_linear.linear(x.contiguous(), packed, bias), residual)
    return lambda x, residual=None: _plus(F.linear(x, weight, bias), residual)


def _plus(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return y if residual is None else y + residual


class BertEncoder:
    """BERT's embeddings and transformer layers (no pooler, no KV cache) over packed sequences.

    `forward(batch)` returns every token's final hidden state, [tokens, hidden], in the batch's packed order. Each
    sequence attends to its own tokens only, all of them (bidirectional), as transformers' BertModel with an
    attention mask computes it.
    """

    def __init__(
        self,
        config: EncoderConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pack: bool | None = None,
        matmul: Fp32Matmul = Fp32Matmul.IEEE,
    ) -> None:
        """`weights`: a transformers state dict of BertModel (or RobertaModel), with or without a "bert."/"roberta."
        prefix; the pooler's and any head's tensors are ignored. `pack`: float32 linears packed for oneDNN (None:
        where available). `matmul`: how float32 linears multiply (split_linear.py; `auto` resolved here, and
        bf16x3 only for float32 on the CPU). KeyError names a missing tensor."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        if pack is None:
            pack = packed_linear.available(self.device, dtype)
        self.packed = pack
        matmul = matmul.resolve() if dtype == torch.float32 and self.device.type == "cpu" else Fp32Matmul.IEEE
        self.matmul = matmul
        w = _prefixed(weights)

        def t(name: str) -> torch.Tensor:
            return w[name].to(device=self.device, dtype=dtype)

        self._word = t("embeddings.word_embeddings.weight")
        self._position = t("embeddings.position_embeddings.weight")
        types = w.get("embeddings.token_type_embeddings.weight")
        self._type = None if types is None else types.to(device=self.device, dtype=dtype)
        self._norm = (t("embeddings.LayerNorm.weight"), t("embeddings.LayerNorm.bias"))
        self._layers = []

        def linear(name: str) -> Linear:
            return _linear(t(f"{name}.weight"), t(f"{name}.bias"), pack, matmul)

        for i in range(config.num_layers):
            p = f"encoder.layer.{i}."
            qkv_w = torch.cat([t(f"{p}attention.self.{n}.weight") for n in ("query", "key", "value")])
            qkv_b = torch.cat([t(f"{p}attention.self.{n}.bias") for n in ("query", "key", "value")])
            self._layers.append(
                _Layer(
                    qkv=_linear(qkv_w, qkv_b, pack, matmul),
                    out=linear(f"{p}attention.output.dense"),
                    norm1=(t(f"{p}attention.output.LayerNorm.weight"), t(f"{p}attention.output.LayerNorm.bias")),
                    up=linear(f"{p}intermediate.dense"),
                    down=linear(f"{p}output.dense"),
                    norm2=(t(f"{p}output.LayerNorm.weight"), t(f"{p}output.LayerNorm.bias")),
                )
            )
        self._act = _ACTIVATIONS[config.activation]

    @classmethod
    def from_model(cls, model: Any, *, pack: bool | None = None, matmul: Fp32Matmul = Fp32Matmul.IEEE) -> BertEncoder:
        """Over a loaded transformers BertModel (or *ForSequenceClassification), in its dtype and on its device."""
        parameter = next(model.parameters())
        return cls(
            EncoderConfig.of(model.config),
            model.state_dict(),
            dtype=parameter.dtype,
            device=parameter.device,
            pack=pack,
            matmul=matmul,
        )

    def forward(self, batch: EncoderBatch) -> torch.Tensor:
        """Every token's final hidden state, [tokens, hidden], packed as `batch` is."""
        cfg = self.config
        if batch.longest > cfg.max_positions:
            raise ValueError(f"a sequence of {batch.longest} tokens exceeds the model's {cfg.max_positions} positions")
        hidden = cfg.hidden_size
        x = self._word[batch.token_ids] + self._position[batch.positions + cfg.position_offset]
        if self._type is not None:
            x = x + (self._type[0] if batch.token_type_ids is None else self._type[batch.token_type_ids])
        x = F.layer_norm(x, (hidden,), *self._norm, cfg.layer_norm_eps)
        for layer in self._layers:
            attended = self._attention(layer.qkv(x), batch)
            x = F.layer_norm(layer.out(attended, x), (hidden,), *layer.norm1, cfg.layer_norm_eps)
            x = F.layer_norm(layer.down(self._act(layer.up(x)), x), (hidden,), *layer.norm2, cfg.layer_norm_eps)
        return x

    __call__ = forward

    def _attention(self, qkv: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        """Each sequence's own bidirectional attention over packed [tokens, 3 * hidden] projections, a call per
        group of sequences (EncoderBatch.groups)."""
        cfg = self.config
        heads, head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        out = qkv.new_empty(qkv.shape[0], cfg.hidden_size)
        for group in batch.groups:
            rows = qkv[group.start : group.stop].view(-1, 3, heads, head_dim)
            block = rows
            if group.scatter is not None:
                block = qkv.new_zeros(group.count * group.longest, 3, heads, head_dim)
                block[group.scatter] = rows
            shape = (group.count, group.longest, 3, heads, head_dim)
            q, k, v = block.view(shape).permute(2, 0, 3, 1, 4).unbind(0)
            # Without padding no mask, so that SDPA may pick its unmasked kernel.
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.key_mask)  # [count, heads, longest, d]
            attended = attended.transpose(1, 2).reshape(group.count * group.longest, cfg.hidden_size)
            out[group.start : group.stop] = attended if group.scatter is None else attended[group.scatter]
        return out


def _prefixed(weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The encoder's own tensors under BertModel's names, whatever head prefix the checkpoint has."""
    if "embeddings.word_embeddings.weight" in weights:
        return weights
    for prefix in ("bert.", "roberta."):
        if f"{prefix}embeddings.word_embeddings.weight" in weights:
            return {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
    raise KeyError("embeddings.word_embeddings.weight")
