"""What the server's front end knows of the model it serves: a LoadedModel without its weights, in plain types.

With the engine core in a process of its own (the default), the front end never runs the model: it tokenizes,
renders chat templates, checks grammars and detokenizes. The child sends it this card once the model is loaded
(core/process.py's Ready), so that the front end needs neither torch nor the model's transformers classes: importing
this module imports neither (the tokenizer, a transformers tokenizer, comes with the card and imports only its
own module when it is unpickled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.model_shape import ModelShape
from llmserve.pooling_config import ClassifierConfig, PoolingConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
