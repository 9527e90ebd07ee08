"""models/classifier.py against transformers' own *ForSequenceClassification: small models with random weights (fixed
seed) built here. A decoder classifier's score head over the last token's final hidden state (hidden states from
transformers' base model, pooled by backends/pooling.py), and BERT's pooler and classifier over [CLS] after the
encoder's forward; the logits and their softmax, each sequence alone and batched (padded, as transformers runs a batch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmserve.engine.backends.encoder_batch import EncoderBatch
from llmserve.engine.backends.pooling import pool
from llmserve.engine.types.pooling import PoolingMode
from llmserve.models.classifier import BertClassifierHead, ScoreHead, classifier_head, probabilities
from llmserve.models.encoder import BertEncoder, EncoderConfig
from tests.testing import tiny_config

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
SEQS = [[5, 17, 99, 3, 42, 8, 61], [7, 7, 120], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [33]]
PAD = 0


def _padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(s) for s in seqs)
    ids = torch.tensor([s + [PAD] * (longest - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in seqs])
    return ids, mask


def _decoder(kind: str) -> Any:
    from transformers import AutoModelForSequenceClassification

    config = tiny_config(kind, vocab_size=256, id2label=LABELS, pad_token_id=PAD)
    config.architectures = [f"{'Llama' if kind == 'llama' else 'Qwen3'}ForSequenceClassification"]
    torch.manual_seed(44)
    return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_decoder_classifier_gives_transformers_logits(kind: str) -> None:
    model = _decoder(kind)
    head = classifier_head(model.config.to_dict(), model.state_dict())
    assert isinstance(head, ScoreHead) and head.pooling is PoolingMode.LAST and head.num_classes == 3
    with torch.inference_mode():
        # Each sequence alone through transformers' base model, its rows packed: the engine's layout.
        hidden = torch.cat([model.model(torch.tensor([s])).last_hidden_state[0] for s in SEQS])
        ours = head(pool(hidden, [len(s) for s in SEQS], head.pooling))
        alone = torch.cat([model(torch.tensor([s])).logits for s in SEQS])
        ids, mask = _padded(SEQS)
        batched = model(input_ids=ids, attention_mask=mask).logits
    assert ours.shape == (4, 3)
    assert torch.allclose(ours, alone, atol=1e-5)
    assert torch.allclose(ours, batched, atol=1e-5)
    assert torch.allclose(probabilities(ours), torch.softmax(alone, -1), atol=1e-6)


def _bert_classifier() -> Any:
    from transformers import BertForSequenceClassification

    config = tiny_config("bert", 256, 64, id2label=LABELS, architectures=["BertForSequenceClassification"])
    torch.manual_seed(44)
    return BertForSequenceClassification(config).eval()


def test_a_bert_classifier_gives_transformers_logits() -> None:
    model = _bert_classifier()
    config = model.config.to_dict()
    encoder = BertEncoder(EncoderConfig.of(config), model.state_dict())  # the "bert." prefix is found
    head = classifier_head(config, model.state_dict())
    assert isinstance(head, BertClassifierHead) and head.pooling is PoolingMode.CLS
    with torch.inference_mode():
        batch = EncoderBatch.pack(SEQS)
        ours = head(pool(encoder(batch), batch.seq_lens, head.pooling))
        ids, mask = _padded(SEQS)
        expected = model(input_ids=ids, attention_mask=mask).logits
        alone = torch.cat([model(torch.tensor([s])).logits for s in SEQS])
    assert torch.allclose(ours, expected, atol=1e-5)
    assert torch.allclose(ours, alone, atol=1e-5)
    assert torch.allclose(probabilities(ours), torch.softmax(expected, -1), atol=1e-6)
    assert torch.allclose(probabilities(ours).sum(-1), torch.ones(4))


def test_heads_not_served_are_refused() -> None:
    model = _bert_classifier()
    config, weights = model.config.to_dict(), model.state_dict()
    with pytest.raises(ValueError, match="no \\*ForSequenceClassification"):
        classifier_head({**config, "architectures": ["BertModel"]}, weights)
    with pytest.raises(ValueError, match="not served"):
        classifier_head({**config, "model_type": "roberta"}, weights)
    with pytest.raises(ValueError, match="3 classes, the config 2 labels"):
        classifier_head({**config, "num_labels": 2, "id2label": {0: "a", 1: "b"}}, weights)
    with pytest.raises(KeyError, match="classifier.weight"):
        classifier_head(config, {k: v for k, v in weights.items() if not k.startswith("classifier.")})


def test_a_one_label_heads_probability_is_the_sigmoid() -> None:
    logits = torch.tensor([[-3.0], [0.0], [2.5]])
    assert torch.allclose(probabilities(logits), torch.sigmoid(logits))
