"""The model as the engine knows it, once the models package (llmserve/models/) has loaded it: its shape, its card,
and the loaded model itself.

- `ModelShape`: the dimensions every part of the engine sizes itself from. `ModelShape.of(config)` is the one place
  that reads a transformers config's dimensions (layers, heads, kv heads, head dim, vocabulary, context, attention
  window), wherever the model came from; everything else (the KV cache and its sizing, the fused forward, the
  compiled kernels' choice, the engine's context cap) takes the `ModelShape` that `LoadedModel.shape` carries.
- `ModelCard`: what the server's front end knows of the model it serves, a LoadedModel without its weights, in plain
  types. With the engine core in a process of its own (the default), the front end never runs the model: it
  tokenizes, renders chat templates, checks grammars and detokenizes. The child sends it this card once the model is
  loaded (core/process.py's Ready), so that the front end needs neither torch nor the model's transformers classes
  (the tokenizer, a transformers tokenizer, comes with the card and imports only its own module when it is
  unpickled).
- `LoadedModel`: the model the engine serves, what the loaders (models/loader.py) hand to the core and the backends.
  What it holds that the models package makes is named here by the protocol the engine uses of it (`ClassifierHead`,
  `MappedWeights`), so that no layer of the engine imports the models package.

Importing it imports neither torch nor transformers (the front end reads shapes and cards without loading torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from llmserve.engine.types.pooling import ClassifierConfig, PoolingConfig, PoolingMode

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True, frozen=True)
class ModelShape:
    """The dimensions every part of the engine sizes itself from.

    `vocab_size` is the width of the logits (config.vocab_size), which may exceed the tokenizer's length.
    `context_length` is the model's position limit; `sliding_window` the attention window the config enables
    (Mistral; Qwen2 with use_sliding_window), or None. `hidden_size` is the residual stream's width and
    `intermediate_size` the MLP's (None where the config names none): the projections' shapes that LoRA adapters
    are checked against (engine/lora/adapters.py).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    sliding_window: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """Read from a transformers config (the text model's, for a multimodal one). Raises ValueError when it
        names no position limit."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(_first(text, "num_attention_heads", "n_head"))
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        hidden = int(_first(text, "hidden_size", "n_embd"))
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        context = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        if not context:
            raise ValueError("model config has neither max_position_embeddings nor n_positions")
        layers = int(_first(text, "num_hidden_layers", "n_layer"))
        inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
        return cls(
            layers,
            heads,
            kv_heads,
            head_dim,
            int(text.vocab_size),
            int(context),
            sliding_window(text),
            hidden,
            None if inner is None else int(inner),
        )

    @property
    def group(self) -> int:
        """Query heads per kv head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V of every layer for one token, at `element_size` bytes an element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def sliding_window(config: Any) -> int | None:
    """The attention window a model config enables, if any (Mistral; Qwen2 with use_sliding_window)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not window or not getattr(text, "use_sliding_window", True):
        return None
    return int(window)


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"model config has none of {', '.join(names)}")


@dataclass(slots=True, frozen=True)
class ModelCard:
    """`dtype` as torch names it without the prefix ("float32", "bfloat16"), `device` as torch.device prints it
    ("cpu", "cuda:0"); `weights` "int8" when the CPU backend quantized the linears, "gguf" when they compute from a
    GGUF's blocks (which the engine process maps; the card carries none of them); the rest as LoadedModel's."""

    tokenizer: PreTrainedTokenizerBase | None
    name: str
    dtype: str
    device: str
    shape: ModelShape
    eos_token_ids: tuple[int, ...]
    weights: str | None = None
    pooling: PoolingConfig | None = None  # what Embed serves; None: no Embed
    generates: bool = True  # False for an encoder or a classifier (Embed only)
    classifier: ClassifierConfig | None = None  # a sequence classifier's labels: Embed returns its logits

    @property
    def vocab_size(self) -> int:
        """The width of the logits (config.vocab_size), which may exceed the tokenizer's length."""
        return self.shape.vocab_size


class ClassifierHead(Protocol):
    """Logits [B, classes] from pooled hidden states [B, hidden]; `pooling` says which token to pool."""

    pooling: PoolingMode

    @property
    def num_classes(self) -> int: ...

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor: ...


class MappedWeights(Protocol):
    """A file whose tensors the model reads through a memory mapping (a GGUF: models/gguf_file.GGUFFile)."""

    @property
    def tensor_bytes(self) -> int: ...  # the bytes of every tensor: what serving the file maps and reads

    def release(self, names: list[str]) -> None: ...  # drop these tensors' pages from the process's mapping


@dataclass(slots=True)
class LoadedModel:
    """A causal LM ready for inference: eval mode, on `device`, gradients off.

    `shape` is the model's dimensions, read from its config once (`ModelShape`). `eos_token_ids` is the union
    of the tokenizer's and the generation config's EOS ids, in that order. `weights`: "int8" when the CPU backend is
    to quantize the linears (`--dtype int8`: the model itself is bfloat16), "gguf" when they compute from a GGUF's
    blocks (`gguf`: that file, mapped; the model's rows and norms are float32), else None.
    """

    model: Any  # a transformers causal LM (PreTrainedModel); its attributes are dynamic
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    dtype: torch.dtype
    device: torch.device
    shape: ModelShape
    eos_token_ids: tuple[int, ...]
    weights: str | None = None
    gguf: MappedWeights | None = None  # models/gguf_file.GGUFFile
    activations: str = "float32"  # with `gguf`: how the kernels take the rows (quant.QuantLinear's activations)
    # Pooling (Embed): the folder's sentence-transformers pipeline, or the --pooling of a generative model, or the
    # token a classifier's head reads; None when the model serves no Embed. `generates`: False for an encoder or a
    # classifier. `encoder`: `model` is a BertEncoder (its own forward, no KV cache).
    pooling: PoolingConfig | None = None
    generates: bool = True
    encoder: bool = False
    # A `*ForSequenceClassification` checkpoint: its labels and the token its head reads (`classifier`), and the head
    # itself (`head`, models/classifier.py's: float32 tensors on `device`), which the backend runs over the pooled
    # final hidden state in place of the Dense modules and normalization. None for any other model.
    classifier: ClassifierConfig | None = None
    head: ClassifierHead | None = None

    @property
    def mapped_bytes(self) -> int:
        """Bytes of weights mapped from a file and not yet read (a GGUF's blocks): what the memory check counts
        beside the KV pool before the backend reads them (engine/backends/__init__.py)."""
        return 0 if self.gguf is None else self.gguf.tensor_bytes

    @property
    def context_length(self) -> int:
        """The model's position limit."""
        return self.shape.context_length

    @property
    def vocab_size(self) -> int:
        """The width of the logits (config.vocab_size), which may exceed the tokenizer's length."""
        return self.shape.vocab_size

    def card(self) -> ModelCard:
        """This model as the front end knows it: all but the weights, in plain types (`ModelCard`)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return ModelCard(
            self.tokenizer,
            self.name,
            dtype,
            str(self.device),
            self.shape,
            self.eos_token_ids,
            self.weights,
            self.pooling,
            self.generates,
            self.classifier,
        )
