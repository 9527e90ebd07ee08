"""Loading models for serving, from local files only: the bundled default GGUF, any GGUF, a saved folder, or
random weights in a known shape.

A GGUF is converted once into a safetensors folder (gguf.py); a model's dimensions are read once into its
`ModelShape` (model_shape.py), which `LoadedModel.shape` carries to everything that sizes itself from them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from llmserve import cpu_features, packaged_models
from llmserve.gguf import (
    MARKER,
    convert_gguf,
    default_gguf_path,
    model_name,
)
from llmserve.model_card import ModelCard
from llmserve.model_shape import RANDOM_SHAPES, ModelShape

log = logging.getLogger(__name__)

__all__ = [
    "MARKER",
    "LoadedModel",
    "ModelShape",
    "convert_gguf",
    "default_gguf_path",
    "from_config",
    "load_model",
    "model_name",
    "random_model",
    "resolve_device",
    "resolve_dtype",
]

RANDOM_PREFIX = "random:"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
INT8 = "int8"  # --dtype int8: a bfloat16 model whose linears the CPU backend quantizes
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(slots=True)
class LoadedModel:
    """A causal LM ready for inference: eval mode, on `device`, gradients off.

    `shape` is the model's dimensions, read from its config once (model_shape.py). `eos_token_ids` is the union
    of the tokenizer's and the generation config's EOS ids, in that order. `weights`: "int8" when the CPU backend is
    to quantize the linears (`--dtype int8`: the model itself is bfloat16), else None.
    """

    model: Any  # a transformers causal LM (PreTrainedModel); its attributes are dynamic
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    dtype: torch.dtype
    device: torch.device
    shape: ModelShape
    eos_token_ids: tuple[int, ...]
    weights: str | None = None

    @property
    def context_length(self) -> int:
        """The model's position limit."""
        return self.shape.context_length

    @property
    def vocab_size(self) -> int:
        """The width of the logits (config.vocab_size), which may exceed the tokenizer's length."""
        return self.shape.vocab_size

    def card(self) -> ModelCard:
        """This model as the front end knows it: all but the weights, in plain types (model_card.py)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return ModelCard(
            self.tokenizer, self.name, dtype, str(self.device), self.shape, self.eos_token_ids, self.weights
        )


def load_model(
    spec: str | os.PathLike[str] | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    cache_root: Path | None = None,
    lora: bool = False,
) -> LoadedModel:
    """Load a model for serving.

    `spec`: None for the default GGUF; a `.gguf` file (converted and cached on first use); a folder with a
    config.json (loaded as is); a packaged model's name (packaged_models.py: extracted and cached on first use);
    or `random:<shape>` (see `random_model`). Anything else raises ValueError.
    `device`: "auto" is cuda when available, else cpu. `dtype`: see `resolve_dtype`; "int8" (CPU only) loads the
    model in bfloat16 for the CPU backend to quantize its linears. `lora`: LoRA adapters will be served, which the
    CPU serves in float32 only, so that "auto" picks float32 there.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev, lora=lora)
    weights = "int8" if dtype == INT8 else None
    spec = os.fspath(spec) if spec is not None else None
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        loaded = random_model(spec[len(RANDOM_PREFIX) :], dtype=dt, device=dev)
        loaded.weights = weights
        return loaded
    if spec is None:
        folder = convert_gguf(default_gguf_path(), cache_root)
    else:
        path = Path(spec).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            folder = convert_gguf(path, cache_root)
        elif path.is_dir() and (path / "config.json").is_file():
            folder = path
        elif (packaged := packaged_models.resolve(spec, cache_root)) is not None:
            folder = packaged  # a model a package ships, by name: extracted once into the cache
        else:
            raise ValueError(
                f"model spec {spec!r} is neither a .gguf file, a folder with a config.json, a packaged model "
                f"({', '.join(m.name for m in packaged_models.PACKAGED_MODELS)}), "
                f"nor {RANDOM_PREFIX}<shape> (shapes: {', '.join(sorted(RANDOM_SHAPES))})"
            )
    loaded = _load_folder(folder, dt, dev)
    loaded.weights = weights
    return loaded


def from_config(
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """A model with random weights drawn from `seed` (the global RNG is left untouched), for tests and benchmarks."""
    dev = resolve_device(device) if isinstance(device, str) else device
    dt = resolve_dtype(dtype, dev) if isinstance(dtype, str) else dtype
    fork_devices = [dev.index or 0] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        # Draw on the target device: a GPU fills 1B parameters in milliseconds, no host copy needed.
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=dt, attn_implementation="sdpa"
            )
    name = getattr(config, "name_or_path", "") or f"random-{config.model_type}"
    return _finish(model, tokenizer, name, dt, dev)


def random_model(
    shape: str,
    *,
    dtype: torch.dtype | str,
    device: torch.device | str,
    seed: int = 0,
) -> LoadedModel:
    """Random weights in a known shape: "smollm2-135m" (the default model's exact dims), "qwen3-0.6b",
    "llama-1b" (Llama-3.2-1B's dims) or "tiny" (two layers of width 64, vocabulary 1024: for tests and demos).
    No tokenizer. Raises ValueError for an unknown shape."""
    make = RANDOM_SHAPES.get(shape)
    if make is None:
        raise ValueError(f"unknown random model shape {shape!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    loaded = from_config(make(), None, dtype=dtype, device=device, seed=seed)
    loaded.name = f"{RANDOM_PREFIX}{shape}"
    return loaded


def resolve_device(device: str) -> torch.device:
    """Map "auto" to cuda when available, else cpu; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, *, lora: bool = False) -> torch.dtype:
    """The model's dtype: "auto" is bfloat16 on CUDA, and on the CPU what cpu_features.auto_dtype picks for its
    instruction set (bfloat16 with AMX, else float32), or float32 with `lora` (the fused CPU forward adds adapter
    deltas in float32 only); "int8" (CPU only) is bfloat16, its linears
    quantized by the CPU backend, and needs AVX512-VNNI or AMX; else one of float32/float16/bfloat16/float64."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if device.type != "cpu":
            return torch.float32
        level = cpu_features.cpu_level()
        picked = cpu_features.auto_dtype(level)
        if lora and picked != "float32":
            log.info("dtype auto: float32 on a CPU of level %s, as LoRA adapters are served", level)
            return torch.float32
        if picked != "bfloat16":
            log.info("dtype auto: %s on a CPU of level %s (bfloat16 is picked with AMX only)", picked, level)
        return _DTYPES[picked]
    if dtype == INT8:
        level = cpu_features.cpu_level()
        if device.type != "cpu" or not cpu_features.at_least(level, cpu_features.INT8_FROM):
            raise ValueError(
                f"dtype int8 runs on CPUs with AVX512-VNNI or AMX (this one: {level}, device {device.type})"
            )
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: auto, {', '.join(_DTYPES)}, {INT8}")
    return _DTYPES[dtype]


def _load_folder(folder: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device)
    tokenizer = None
    if any((folder / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    name = model_name(folder)
    try:
        name = json.loads((folder / MARKER).read_text()).get("name", name)
    except (OSError, ValueError):
        pass  # not one of our conversions: the folder name will do
    return _finish(model, tokenizer, name, dtype, device)


def _finish(
    model: Any,
    tokenizer: PreTrainedTokenizerBase | None,
    name: str,
    dtype: torch.dtype,
    device: torch.device,
) -> LoadedModel:
    model.eval()
    model.requires_grad_(False)
    config = model.config
    try:
        shape = ModelShape.of(config)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    generation_config = getattr(model, "generation_config", None)
    eos = _as_ids(tokenizer.eos_token_id if tokenizer is not None else None)
    eos += _as_ids(generation_config.eos_token_id if generation_config is not None else config.eos_token_id)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        dtype=dtype,
        device=device,
        shape=shape,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def _as_ids(value: int | list[int] | tuple[int, ...] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def main(argv: list[str] | None = None) -> int:
    """`python -m llmserve.models [SPEC]`: load (converting and caching a GGUF once) the model a server would.

    `make model` and the Dockerfile run it, so that the image holds the converted default model.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m llmserve.models", description=main.__doc__)
    parser.add_argument("spec", nargs="?", default=None, help="model spec as for --model; default: the default model")
    parser.add_argument("--cache-dir", default=None, help="conversion cache; default: $LLMSERVE_CACHE_DIR or ~/.cache")
    args = parser.parse_args(argv)
    cache = Path(args.cache_dir) if args.cache_dir else None
    loaded = load_model(args.spec, device="cpu", dtype="float32", cache_root=cache)
    print(f"model ready: {loaded.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
