"""Sequence-classification heads: a pooled final hidden state in, one logit per class out.

Two heads cover transformers' `*ForSequenceClassification` checkpoints:

- `ScoreHead` (Llama, Qwen2/3, Mistral, Gemma...: reward models and decoder classifiers): `score`, one linear
  without bias over the final (normed) hidden state of the input's last token;
- `BertClassifierHead` (BertForSequenceClassification): BERT's pooler, tanh(dense(h)), over the first token
  ([CLS]), then `classifier`, a linear with bias (dropout is off in inference).

Each is an engine/types/model.ClassifierHead, the protocol the backends run a head by. The pooled state comes from
backends/pooling.py (LAST or CLS, as `ClassifierConfig.pooling` says); the probabilities Embed returns are
`probabilities(logits)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmserve.engine.types.model import ClassifierHead
from llmserve.engine.types.pooling import PoolingMode
from llmserve.models.pooling_config import classifier_from_config

__all__ = ["BertClassifierHead", "ScoreHead", "classifier_head", "probabilities"]


@dataclass(slots=True)
class ScoreHead:
    """A decoder classifier's `score` linear [classes, hidden], no bias, over the last token's hidden state."""

    weight: torch.Tensor
    pooling: PoolingMode = PoolingMode.LAST

    @property
    def num_classes(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.linear(pooled.to(self.weight.dtype), self.weight)


@dataclass(slots=True)
class BertClassifierHead:
    """BERT's pooler (dense + tanh over [CLS]) and classifier linear."""

    pooler_weight: torch.Tensor
    pooler_bias: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    pooling: PoolingMode = PoolingMode.CLS

    @property
    def num_classes(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        x = pooled.to(self.weight.dtype)
        return F.linear(torch.tanh(F.linear(x, self.pooler_weight, self.pooler_bias)), self.weight, self.bias)


def classifier_head(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ClassifierHead:
    """The head of a `*ForSequenceClassification` checkpoint from its config.json contents and its state dict
    (transformers' names: "score.weight"; "bert.pooler.dense.*" and "classifier.*").

    ValueError when the config is no sequence classifier or its head is not one of the two served; KeyError names a
    missing tensor.
    """
    declared = classifier_from_config(dict(config))
    if declared is None:
        raise ValueError("the config declares no *ForSequenceClassification architecture")

    def t(name: str) -> torch.Tensor:
        return weights[name].to(device=device, dtype=dtype)

    head: ClassifierHead
    if declared.pooling is PoolingMode.LAST:
        head = ScoreHead(t("score.weight"))
    elif str(config.get("model_type")) == "bert":
        head = BertClassifierHead(
            t("bert.pooler.dense.weight"), t("bert.pooler.dense.bias"), t("classifier.weight"), t("classifier.bias")
        )
    else:
        raise ValueError(f"the classifier head of {declared.architecture} is not served")
    if head.num_classes != len(declared.labels):
        raise ValueError(f"the head has {head.num_classes} classes, the config {len(declared.labels)} labels")
    return head


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """The class probabilities of `logits` [B, classes], in float32: softmax over the classes, or the sigmoid of a
    one-label head's logit (as sentence-transformers' CrossEncoder; a softmax over one value is always 1.0)."""
    if logits.shape[-1] == 1:
        return torch.sigmoid(logits.float())
    return torch.softmax(logits.float(), dim=-1)
