"""Loading models for serving, from local files only: the bundled default GGUF, any GGUF, a saved folder, a
packaged model by name, or random weights in a known shape; what it gives is the engine's `LoadedModel`
(engine/types/model.py).

A GGUF on the CPU is served from its own blocks by default (`--dtype auto` or `gguf`): the file is memory-mapped and
its linears computed from the blocks (gguf_file.py, gguf_model.py), its tokenizer and config cached once under the
cache root (gguf.file_metadata). `--dtype float32/bfloat16/int8`, and any GGUF on CUDA, convert it once into a
safetensors folder of float weights (gguf.convert_gguf). A model's dimensions are read once into its `ModelShape`,
which `LoadedModel.shape` carries to everything that sizes itself from them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from llmserve import cpu_features
from llmserve.engine.types.model import LoadedModel, ModelShape
from llmserve.engine.types.pooling import ClassifierConfig, PoolingConfig, PoolingMode
from llmserve.models import packaged
from llmserve.models.cache import MARKER
from llmserve.models.gguf import convert_gguf, default_gguf_path, file_metadata, model_name
from llmserve.models.gguf_file import GGUFFile
from llmserve.models.pooling_config import read_classifier_config, read_pooling_config
from llmserve.models.random_shapes import RANDOM_SHAPES

log = logging.getLogger(__name__)

__all__ = ["from_config", "load_model", "random_model", "resolve_device", "resolve_dtype"]

RANDOM_PREFIX = "random:"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
INT8 = "int8"  # --dtype int8: a bfloat16 model whose linears the CPU backend quantizes
GGUF = "gguf"  # --dtype gguf: a GGUF served from its own blocks (the CPU's default for a GGUF: --dtype auto)
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def load_model(
    spec: str | os.PathLike[str] | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    cache_root: Path | None = None,
    lora: bool = False,
    gguf_activations: str = "float32",
    pooling: str | None = None,
    fp32_matmul: str = "auto",
) -> LoadedModel:
    """Load a model for serving.

    `spec`: None for the default GGUF; a `.gguf` file; a folder with a config.json (loaded as is); a packaged
    model's name (packaged.py: extracted and cached on first use); or `random:<shape>` (see `random_model`).
    Anything else raises ValueError. `device`: "auto" is cuda when available, else cpu. `dtype`: "gguf" serves a
    GGUF from its blocks on the CPU (memory-mapped; its tokenizer and config cached on first use), and so does
    "auto" for a GGUF on the CPU; otherwise see `resolve_dtype`, a GGUF converted into float weights and cached on
    first use; "int8" (CPU only) loads the model in bfloat16 for the CPU backend to quantize its linears. `lora`:
    LoRA adapters will be served, which the CPU serves in float32 only, so that "auto" picks float32 there (a
    GGUF's blocks take float32 rows: they serve adapters as they are).
    `gguf_activations`: with a GGUF's blocks, "float32" input rows (the default: the float32 path's tokens) or
    "int8" (quantized per block of 32, as llama.cpp does).
    `pooling` ("last", "mean", "cls", "max"): a generative model serves Embed too, its final hidden states pooled
    so (unnormalized by default); None: a folder's sentence-transformers pooling where it has one (an encoder folder
    always serves its own; `pooling` then only changes its mode). A `*ForSequenceClassification` folder (a Llama/Qwen
    decoder with a `score` head, or a BERT classifier) is served as a classifier: Embed only, its head's logits per
    input (`classifier`, `head`); `pooling` is refused for it (the head fixes the token it reads). `fp32_matmul`:
    how an encoder's float32 linears multiply ("auto", "ieee", "bf16x3": split_linear.Fp32Matmul).
    Raises gguf_file.GGUFError, naming the file, for a GGUF that is truncated, corrupt, or holds block types or an
    architecture its blocks cannot be served in.
    """
    loaded = _load(spec, device, dtype, cache_root, lora, gguf_activations, fp32_matmul)
    return with_pooling(loaded, folder_of(spec, cache_root), pooling)


def folder_of(spec: str | os.PathLike[str] | None, cache_root: Path | None) -> Path | None:
    """The model folder a spec names (a folder, or a packaged model's), else None (a GGUF, random weights)."""
    if spec is None:
        return None
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if text.startswith(RANDOM_PREFIX) or path.suffix == ".gguf":
        return None
    return packaged.resolve(text, cache_root)


def with_pooling(loaded: LoadedModel, folder: Path | None, pooling: str | None) -> LoadedModel:
    """`loaded` serving Embed as `pooling` says (see load_model): its pooling config set, from the folder's
    sentence-transformers files or the flag."""
    if loaded.pooling is None and folder is not None and loaded.generates:
        loaded.pooling = read_pooling_config(folder)
    if pooling is None:
        return loaded
    if loaded.classifier is not None:
        raise ValueError(f"{loaded.name}: --pooling does not apply to a classifier, whose head reads its own token")
    mode = PoolingMode.parse(pooling)
    if loaded.pooling is not None:
        loaded.pooling = dataclasses.replace(loaded.pooling, mode=mode)
        return loaded
    hidden = loaded.shape.hidden_size
    if hidden is None:
        raise ValueError(f"{loaded.name}: --pooling needs the model's hidden size, which its config does not give")
    loaded.pooling = PoolingConfig(mode=mode, normalize=False, hidden_size=hidden)
    return loaded


def _load(
    spec: str | os.PathLike[str] | None,
    device: str,
    dtype: str,
    cache_root: Path | None,
    lora: bool,
    gguf_activations: str,
    fp32_matmul: str,
) -> LoadedModel:
    dev = resolve_device(device)
    spec = os.fspath(spec) if spec is not None else None
    gguf_file: Path | None = None
    folder: Path | None = None
    if spec is None:
        gguf_file = default_gguf_path()
    elif not spec.startswith(RANDOM_PREFIX):
        path = Path(spec).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            gguf_file = path
        elif path.is_dir() and (path / "config.json").is_file():
            folder = path
        elif (shipped := packaged.resolve(spec, cache_root)) is not None:
            folder = shipped  # a model a package ships, by name: extracted once into the cache
        else:
            raise ValueError(
                f"model spec {spec!r} is neither a .gguf file, a folder with a config.json, a packaged model "
                f"({', '.join(m.name for m in packaged.PACKAGED_MODELS)}), "
                f"nor {RANDOM_PREFIX}<shape> (shapes: {', '.join(sorted(RANDOM_SHAPES))})"
            )
    if dtype == GGUF or (dtype == "auto" and gguf_file is not None and dev.type == "cpu"):
        if gguf_file is None or dev.type != "cpu":
            raise ValueError(f"dtype gguf serves a .gguf file on the CPU (model {spec!r}, device {dev.type})")
        return load_gguf_blocks(gguf_file, cache_root, gguf_activations)
    dt = resolve_dtype(dtype, dev, lora=lora)
    weights = "int8" if dtype == INT8 else None
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        loaded = random_model(spec[len(RANDOM_PREFIX) :], dtype=dt, device=dev)
        loaded.weights = weights
        return loaded
    if gguf_file is not None:
        folder = convert_gguf(gguf_file, cache_root)
    if folder is None:  # not reached: a spec that is neither random nor a GGUF named its folder above
        raise ValueError(f"model spec {spec!r} names no model")
    if _is_encoder(folder):
        # An encoder runs in float32 unless asked otherwise: its vectors are compared with the library's. Its linears
        # multiply as --fp32-matmul says (auto: three bfloat16 products on AMX, within ~4e-6 of float32's).
        return load_encoder(folder, torch.float32 if dtype == "auto" else dt, dev, fp32_matmul)
    classifier = read_classifier_config(folder)
    loaded = _load_folder(folder, dt, dev, classifier=classifier is not None)
    loaded.weights = weights
    if classifier is not None:
        as_classifier(loaded, folder, classifier)
    return loaded


def as_classifier(loaded: LoadedModel, folder: Path, classifier: ClassifierConfig) -> None:
    """`loaded`, a decoder read from a `*ForSequenceClassification` folder, served as that classifier: the causal
    LM class reads the folder's `model.*` tensors as they are (_load_folder ties its LM head, which the checkpoint
    lacks, to the input embeddings: never computed, as nothing samples, and no memory of its own), the `score` head is
    read from the folder, and the final hidden state of each input's last token goes through it (pooling LAST, no
    normalization). ValueError for a head that is not a decoder's."""
    from llmserve.models.classifier import classifier_head

    if classifier.pooling is not PoolingMode.LAST:
        raise ValueError(f"{folder}: {classifier.architecture} is not served")
    hidden = loaded.shape.hidden_size
    if hidden is None:
        raise ValueError(f"{folder}: a classifier needs the model's hidden size, which its config does not give")
    config = json.loads((folder / "config.json").read_text())
    loaded.head = classifier_head(config, _read_tensors(folder, ("score.weight",)), device=loaded.device)
    loaded.classifier = classifier
    loaded.pooling = PoolingConfig(mode=PoolingMode.LAST, normalize=False, hidden_size=hidden)
    loaded.generates = False


def _is_encoder(folder: Path) -> bool:
    from llmserve.models.encoder import ENCODER_TYPES

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in ENCODER_TYPES


def load_encoder(folder: Path, dtype: torch.dtype, device: torch.device, fp32_matmul: str = "ieee") -> LoadedModel:
    """A BERT-family encoder folder with its sentence-transformers pipeline (modules.json), or a BERT classifier
    (BertForSequenceClassification: its pooler and classifier over [CLS]): served for Embed only, its `model` the
    engine's BertEncoder over the folder's weights (no transformers model is built). ValueError for an encoder folder
    with neither a pipeline the server reproduces (pooling_config.py) nor a classifier head it serves. `fp32_matmul`:
    how its float32 linears multiply (split_linear.Fp32Matmul: auto, ieee, bf16x3)."""
    from llmserve.engine.backends.cpu.split_linear import Fp32Matmul
    from llmserve.models.classifier import classifier_head
    from llmserve.models.encoder import BertEncoder, EncoderConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    state = _read_state(folder)
    classifier = read_classifier_config(folder)
    head = None
    if classifier is not None:
        head = classifier_head(config.to_dict(), state, device=device)
        hidden = int(config.hidden_size)
        pooling: PoolingConfig | None = PoolingConfig(mode=classifier.pooling, normalize=False, hidden_size=hidden)
    else:
        pooling = read_pooling_config(folder)
    if pooling is None:
        raise ValueError(f"{folder}: an encoder without sentence-transformers' modules.json (no pooling to serve)")
    encoder = BertEncoder(EncoderConfig.of(config), state, dtype=dtype, device=device, matmul=Fp32Matmul(fp32_matmul))
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    try:
        shape = ModelShape.of(config)
    except ValueError as exc:
        raise ValueError(f"{folder}: {exc}") from exc
    return LoadedModel(
        model=encoder,
        tokenizer=tokenizer,
        name=model_name(folder),
        dtype=dtype,
        device=device,
        shape=shape,
        eos_token_ids=(),
        pooling=pooling,
        generates=False,
        encoder=True,
        classifier=classifier,
        head=head,
    )


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    state: dict[str, torch.Tensor] = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return state


def _read_tensors(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named tensors of a folder's checkpoint, without reading the rest (safetensors, one file or sharded with
    its index; else pytorch_model.bin, read whole). KeyError names a tensor the checkpoint lacks."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = {name: folder / weight_map[name] for name in names if name in weight_map}
    elif (folder / "model.safetensors").is_file():
        files = dict.fromkeys(names, folder / "model.safetensors")
    else:
        state = _read_state(folder)
        return {name: state[name] for name in names}
    out = {}
    for name in names:
        if name not in files:
            raise KeyError(f"{folder}: no tensor {name!r}")
        with safe_open(str(files[name]), framework="pt") as f:
            if name not in f.keys():
                raise KeyError(f"{folder}: no tensor {name!r}")
            out[name] = f.get_tensor(name)
    return out


def load_gguf_blocks(path: Path, cache_root: Path | None = None, activations: str = "float32") -> LoadedModel:
    """A GGUF served from its own blocks on the CPU: the file mapped (nothing of its tensors read but the norms),
    the tokenizer and config from their cache folder (gguf.file_metadata, made on first use), the model built
    over the blocks (gguf_model.build_model). `weights` "gguf", `dtype` float32 (the rows' and the KV cache's);
    `activations` as quant.QuantLinear takes them."""
    if activations not in ("int8", "float32"):
        raise ValueError(f"gguf activations must be int8 or float32, got {activations!r}")
    from llmserve.models.gguf_model import build_model

    file = GGUFFile.open(path)
    folder = file_metadata(file.path, cache_root)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = build_model(file, config)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = None
    if any((folder / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    loaded = _finish(model, tokenizer, model_name(file.path), torch.float32, torch.device("cpu"))
    loaded.weights = GGUF
    loaded.gguf = file
    loaded.activations = activations
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
    deltas in float32 only); "int8" (CPU only) is bfloat16, its linears quantized by the CPU backend; else one of
    float32/float16/bfloat16/float64. On the CPU a dtype its level cannot serve is refused (cpu_features.refusal:
    bfloat16 below AVX-512, int8 below AVX512-VNNI, float16 everywhere), naming what serves instead."""
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
    if dtype == INT8 and device.type != "cpu":
        raise ValueError(f"dtype int8 runs on the CPU only (device {device.type}): CUDA serves bfloat16")
    if device.type == "cpu":
        refused = cpu_features.refusal(dtype, cpu_features.cpu_level())
        if refused is not None:
            raise ValueError(refused)
    if dtype == INT8:
        return torch.bfloat16
    if dtype == GGUF:
        return torch.float32  # the rows' dtype beside a GGUF's blocks
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: auto, {', '.join(_DTYPES)}, {INT8}, {GGUF}")
    return _DTYPES[dtype]


def _load_folder(folder: Path, dtype: torch.dtype, device: torch.device, *, classifier: bool = False) -> LoadedModel:
    # A classifier's checkpoint has no LM head: tied to the embeddings, the causal-LM class neither draws a random
    # one nor holds vocabulary x hidden more (as_classifier).
    tie = {"tie_word_embeddings": True} if classifier else {}
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=dtype, attn_implementation="sdpa", **tie
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
