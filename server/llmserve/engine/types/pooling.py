"""What an embedding model serves, as the engine's layers share it: how one vector is made from an input's hidden
states (`PoolingMode`), a sentence-transformers pipeline after the transformer (`PoolingConfig`, its `DenseModule`s)
and a sequence classifier's labels (`ClassifierConfig`). Plain records: models/pooling_config.py reads them from a
model folder, the backends pool and project by them, requests and the edge name the modes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' mode names, old and new, to ours.
_MODE_NAMES = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last", "last": "last"}
# Dense activations the server reproduces, by the torch class path sentence-transformers saves.
DENSE_ACTIVATIONS = frozenset({"identity", "tanh", "relu", "gelu", "sigmoid"})


class PoolingMode(enum.Enum):
    """How one vector is made from an input's final hidden states."""

    CLS = "cls"  # the first token's
    MEAN = "mean"  # the mean over all tokens, special tokens included
    LAST = "last"  # the last token's
    MAX = "max"  # the element-wise maximum over tokens

    @classmethod
    def parse(cls, name: str) -> PoolingMode:
        """A mode from its name (`--pooling`, or sentence-transformers' "lasttoken"); ValueError for others."""
        mode = _MODE_NAMES.get(name.strip().lower())
        if mode is None:
            raise ValueError(f"unknown pooling {name!r}; known: cls, mean, last, max")
        return cls(mode)


@dataclass(frozen=True, slots=True)
class DenseModule:
    """A sentence-transformers Dense projection after pooling: `activation(x @ W.T + b)`.

    `folder` holds its weights (model.safetensors, or pytorch_model.bin in older saves) under the names
    "linear.weight" and "linear.bias"; `activation` is one of DENSE_ACTIVATIONS.
    """

    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """An embedding model's pipeline after its transformer: pool, project (`dense`, in order), normalize.

    `hidden_size` is the width pooling sees. `max_seq_length` is sentence-transformers' input limit in tokens
    (None: the model's context); it truncates longer inputs, where the server refuses them unless asked to
    truncate. `do_lower_case`: sentence-transformers lowercases texts before tokenizing. `prompts`: the instruction
    prompts of config_sentence_transformers.json as (name, text) pairs in the file's order, `default_prompt_name`
    the one prepended when a request names none ("" for none). `include_prompt` false: the Pooling module leaves a
    prompt's tokens out of the mean, which the server does not reproduce (it refuses prompts then).
    """

    mode: PoolingMode
    normalize: bool
    hidden_size: int
    dense: tuple[DenseModule, ...] = ()
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str = ""
    include_prompt: bool = True

    @property
    def embedding_size(self) -> int:
        """The length of the vectors: the last Dense module's output, else the hidden size."""
        return self.dense[-1].out_features if self.dense else self.hidden_size


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    """A `*ForSequenceClassification` checkpoint: its architecture, its class labels in class order, and the
    token its head reads (CLS for BERT-family encoders, LAST for decoders)."""

    architecture: str
    labels: tuple[str, ...]
    pooling: PoolingMode
