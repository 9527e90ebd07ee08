"""Reading a LoRA adapter in the PEFT format, checked against the served model before anything uses it.

An adapter is a folder with `adapter_config.json` (read by PEFT's own `PeftConfig`) and
`adapter_model.safetensors` (read by `safetensors`): for each target projection of each layer, A [r, in] and
B [out, r], so that the projection computes y = x W^T + scale * (x A^T) B^T. The scale is PEFT's: lora_alpha / r,
or lora_alpha / sqrt(r) with `use_rslora`, with r and alpha taken per module from `rank_pattern` / `alpha_pattern`
as PEFT matches them (`get_pattern_key` against the module's name in the base model).

What is served: plain LoRA on the Llama-family attention and MLP projections (q/k/v/o, gate/up/down) of a model of
the served shape. Refused at load, with a message naming the file, the tensor or module, and what does not fit:
another PEFT method, a LoRA variant that changes the math (DoRA, a LoRA bias, trained biases, extra trained
modules, new tokens, layer replication, ...), a module outside the target set, a layer the model lacks, a tensor
whose shape is not the projection's, a rank above `max_rank`, a module with A or B missing, non-finite weights.
A missing folder or file is `AdapterNotFound`; anything else `AdapterRefused` (both name the path). Nothing is
ever fetched from a hub: the files are checked to exist before PEFT is asked.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmserve.engine.types.adapters import AdapterNotFound, AdapterRefused
from llmserve.engine.types.model import ModelShape

__all__ = ["AdapterNotFound", "AdapterRefused", "LoraAdapter", "LoraModule", "projection_shapes", "read_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"

# The projections an adapter may target, by the submodule of the decoder layer that holds them.
TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# PEFT's key for a LoRA factor of a projection of a Llama-family causal LM (the adapter name already removed).
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<module>\w+)\.lora_(?P<factor>[AB])\.weight"
)
# LoraConfig fields that change the math beyond y += scale * x A^T B^T (DoRA, biases, extra trained modules or
# tokens, replicated layers, parameter targets, and PEFT's LoRA variants); any of them set (truthy) is refused.
_UNSUPPORTED = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "trainable_token_indices",
    "layer_replication",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "velora_config",
    "monteclora_config",
    "use_bdlora",
    "megatron_config",
)


@dataclass(slots=True, frozen=True)
class LoraModule:
    """One projection's factors: a [rank, in], b [out, rank], float32 on the CPU; the delta is scale * x a^T b^T."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(slots=True, frozen=True)
class LoraAdapter:
    """A read and checked adapter: its factors by (layer, projection name), in host memory.

    `digest` (BLAKE2b-256 over the config and weights files' bytes) is the adapter's identity for the caches
    (cache_keys.adapter_root): the same files give the same digest in any process, other files another one.
    """

    path: str
    modules: dict[tuple[int, str], LoraModule]
    digest: bytes

    @property
    def rank(self) -> int:
        """The largest rank of any of its modules (what a device slot must hold)."""
        return max(m.rank for m in self.modules.values())

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(name for _, name in self.modules)

    @property
    def nbytes(self) -> int:
        """Host memory its factors take."""
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of a Llama-family model of this shape. Raises
    ValueError when the shape lacks the hidden or intermediate size."""
    if shape.hidden_size is None or shape.intermediate_size is None:
        raise ValueError("the served model's config names no hidden or intermediate size")
    hidden, inner = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }


def read_adapter(folder: Path | str, shape: ModelShape, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT adapter in `folder` against a model of `shape`, ranks up to `max_rank`.

    Raises AdapterNotFound or AdapterRefused (naming the file and what does not fit)."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise AdapterNotFound(folder, "no such adapter folder")
    if not config_path.is_file():
        raise AdapterNotFound(config_path, "missing: an adapter folder holds adapter_config.json (PEFT's format)")
    if not weights_path.is_file():
        why = "missing"
        if (folder / PICKLE_WEIGHTS_FILE).is_file():
            why += f" ({PICKLE_WEIGHTS_FILE} is there, but pickled weights are never loaded: save with safetensors)"
        raise AdapterNotFound(weights_path, why)
    config = _read_config(config_path)
    try:
        shapes = projection_shapes(shape)
    except ValueError as exc:
        raise AdapterRefused(folder, str(exc)) from None
    factors = _read_weights(weights_path)
    modules = _modules(weights_path, factors, config, shape, shapes, max_rank)
    digest = hashlib.blake2b(digest_size=32)
    for path in (config_path, weights_path):
        data = path.read_bytes()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return LoraAdapter(str(folder), modules, digest.digest())


def _read_config(path: Path) -> Any:
    """PEFT's LoraConfig from the file, with what this server cannot serve refused."""
    from peft import PeftConfig  # a heavy import, paid only where adapters are read

    try:
        json.loads(path.read_text())  # a clear message for a damaged file, before PEFT's own
        config = PeftConfig.from_pretrained(str(path.parent))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRefused(path, f"cannot be read as JSON ({exc})") from None
    except Exception as exc:  # PEFT raises TypeError/ValueError/KeyError for fields it does not know or accept
        raise AdapterRefused(path, f"not a PEFT adapter config ({type(exc).__name__}: {exc})") from None
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    if peft_type != "LORA":
        raise AdapterRefused(path, f"peft_type {peft_type} is not served (only LORA)")
    for field_name in _UNSUPPORTED:
        if getattr(config, field_name, None):
            raise AdapterRefused(path, f"{field_name} is set: only plain LoRA (y += scale * x A^T B^T) is served")
    if getattr(config, "bias", "none") != "none":
        raise AdapterRefused(path, f"bias {config.bias!r}: trained biases are not served (only 'none')")
    if getattr(config, "fan_in_fan_out", False):
        raise AdapterRefused(path, "fan_in_fan_out is set: that layout is for GPT-2's Conv1D, not Llama's Linear")
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterRefused(path, f"cannot be read as safetensors ({exc})") from None


def _modules(
    path: Path,
    factors: dict[str, torch.Tensor],
    config: Any,
    shape: ModelShape,
    shapes: dict[str, tuple[int, int]],
    max_rank: int,
) -> dict[tuple[int, str], LoraModule]:
    from peft.utils.other import get_pattern_key

    rank_pattern: dict[str, int] = dict(config.rank_pattern or {})
    alpha_pattern: dict[str, float] = dict(config.alpha_pattern or {})
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in factors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterRefused(path, f"tensor {key}: not a LoRA factor of a Llama-family projection")
        layer, module = int(match["layer"]), match["module"]
        if TARGET_MODULES.get(module) != match["parent"]:
            served = ", ".join(TARGET_MODULES)
            raise AdapterRefused(path, f"tensor {key}: module {match['parent']}.{module} is not served ({served})")
        if layer >= shape.num_layers:
            raise AdapterRefused(path, f"tensor {key}: layer {layer}, but the served model has {shape.num_layers}")
        pairs.setdefault((layer, module), {})[match["factor"]] = tensor
    if not pairs:
        raise AdapterRefused(path, "holds no LoRA factors")
    modules: dict[tuple[int, str], LoraModule] = {}
    order = list(TARGET_MODULES)
    for (layer, module), pair in sorted(pairs.items(), key=lambda item: (item[0][0], order.index(item[0][1]))):
        name = f"model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterRefused(path, f"module {name}: {missing} is missing")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        rank = int(a.shape[0]) if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or b.shape[1] != rank:
            raise AdapterRefused(
                path,
                f"module {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the served model's "
                f"projection ({fan_in} -> {fan_out}): expected lora_A (r, {fan_in}) and lora_B ({fan_out}, r)",
            )
        if rank < 1 or rank > max_rank:
            raise AdapterRefused(path, f"module {name}: rank {rank} is above --max-lora-rank {max_rank}")
        expected = rank_pattern.get(get_pattern_key(list(rank_pattern), name), config.r)
        if rank != expected:
            raise AdapterRefused(path, f"module {name}: rank {rank} in the weights, {expected} in {CONFIG_FILE}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterRefused(path, f"module {name}: factors of dtype {a.dtype}/{b.dtype}, not floating point")
        a, b = a.float().contiguous(), b.float().contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterRefused(path, f"module {name}: non-finite values in its factors")
        alpha = float(alpha_pattern.get(get_pattern_key(list(alpha_pattern), name), config.lora_alpha))
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        modules[layer, module] = LoraModule(a, b, float(scale))
    return modules
