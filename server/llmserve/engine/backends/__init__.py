"""Execution backends: the tensor side of the engine, behind one `Backend` protocol (base.py).

- `cpu` (backends/cpu): the paged step with the compiled decode kernel, blocked chunk attention, packed
  oneDNN linears and the fused Llama-family forward;
- `torch` (torch_paged.py): any transformers causal LM through the paged attention function, CPU or CUDA;
- `cuda` (cuda.py): transformers' forward over the Triton varlen kernel, decode steps replayed from CUDA graphs
  captured at start-up;
- `encoder` (encoder_backend.py): a BERT-family encoder's pooled vectors, no KV cache.

None derives from another: the three decoder backends each hold the same collaborators (paged.py), built once with
their own choices: the KV cache (base.py), sized and allocated once here before the backend is built; the persistent
input batch (input_batch.py); a packer with one attention-metadata builder per kernel (metadata.py, the types in
attention.py) or the varlen kernel's step buffers (step_buffers.py); LoRA slots (lora_slots.py); a model forward
(transformers' own, or the CPU's fused one); and the step that samples, pools and keeps each sequence's state
between steps, behind `Backend.release`. The slot formula is slots.py's; the model's shape `LoadedModel.shape`.

`create_backend` is the one place that asks which device the model is on.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from llmserve.engine.backends.base import Backend, KVCache, kv_blocks
from llmserve.engine.backends.memory_check import available_bytes, check_fits
from llmserve.engine.config import EngineConfig
from llmserve.engine.types.model import LoadedModel

__all__ = ["Backend", "Kind", "create_backend"]

log = logging.getLogger(__name__)

Kind = Literal["cpu", "torch", "cuda"]


def backend_kind(loaded: LoadedModel, config: EngineConfig) -> Kind:
    """The backend the model's device calls for: cpu on the CPU, cuda (graphs) on CUDA unless switched off or
    without the varlen kernel the graphs are built on (`--attention-kernel torch`, or no Triton)."""
    device = loaded.device.type
    if device == "cpu":
        return "cpu"
    if device == "cuda" and config.cuda_graphs:
        from llmserve.engine.backends.torch_paged import varlen_kernel

        if varlen_kernel(config.attention_kernel, loaded.device) is not None:
            return "cuda"
        log.warning("CUDA graphs need the Triton varlen kernel: serving without them")
    return "torch"


def create_backend(
    loaded: LoadedModel,
    config: EngineConfig,
    max_model_len: int | None = None,
    *,
    kind: Kind | None = None,
    capture: bool = True,
) -> Backend:
    """The backend for the model's device (or `kind`), built whole: KV cache sized and allocated once, weights
    packed, graphs captured once (`capture=False`: the CUDA backend's padded paths run eagerly, as the CPU tests
    use it). `max_model_len` bounds the sequences it serves (default: the model's context).

    Raises when a part the config requires cannot be had (`--cpu-kernels require` without the compiled
    kernels, a CUDA graph that cannot be captured), and memory_check.InsufficientMemory when weights mapped from a
    file (a GGUF's blocks) and the KV pool would not fit in the host's available memory.
    """
    if loaded.encoder:  # its own forward, no KV cache to size
        from llmserve.engine.backends.encoder_backend import EncoderBackend

        return EncoderBackend(loaded, config, max_model_len or loaded.context_length)
    kind = kind or backend_kind(loaded, config)
    max_len = max_model_len or loaded.context_length
    reserved = 0
    if kind == "cuda" and config.kv_cache_tokens is None:  # what the graphs will take, before the cache is sized
        from llmserve.engine.backends.cuda import graph_reserve

        reserved = graph_reserve(loaded, config, max_len)
    num_blocks = kv_blocks(config, loaded.shape, loaded.dtype, loaded.device, reserved)
    if loaded.mapped_bytes:  # weights mapped, not yet read: refuse now what cannot fit once they are
        element = torch.empty((), dtype=loaded.dtype).element_size()
        kv_bytes = num_blocks * config.block_size * loaded.shape.kv_bytes_per_token(element)
        check_fits(loaded.name, loaded.mapped_bytes, kv_bytes, available_bytes())
    kv = KVCache(loaded.shape, num_blocks, config.block_size, loaded.dtype, loaded.device)
    if kind == "cpu":
        from llmserve.engine.backends.cpu.backend import CpuBackend

        return CpuBackend(loaded, config, kv, max_len)
    if kind == "cuda":
        from llmserve.engine.backends.cuda import CudaBackend

        return CudaBackend(loaded, config, kv, max_len, capture=capture, reserved_bytes=reserved)
    from llmserve.engine.backends.torch_paged import TorchPagedBackend

    return TorchPagedBackend(loaded, config, kv, max_len)
