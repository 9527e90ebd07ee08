"""Execution backends: the tensor side of the engine, behind one `Backend` protocol (base.py).

- `cpu` (backends/cpu): the paged forward with the compiled decode kernel, blocked chunk attention, packed
  oneDNN linears and the fused Llama-family forward;
- `torch` (torch_paged.py): any transformers causal LM through the paged attention function, CPU or CUDA;
- `cuda` (cuda.py): the torch backend with decode steps replayed from CUDA graphs captured at start-up.

`create_backend` is the one place that asks which device the model is on.
"""

from __future__ import annotations

from llmserve.engine.backends.base import Backend, KVShape
from llmserve.engine.config import EngineConfig
from llmserve.models import LoadedModel

__all__ = ["Backend", "KVShape", "create_backend"]


def create_backend(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> Backend:
    """The backend for the model's device, built whole: KV cache allocated, weights packed, graphs captured.

    Raises when a part the config requires cannot be had (`--cpu-kernels require` without the compiled
    kernels, a CUDA graph that cannot be captured).
    """
    device = loaded.device.type
    if device == "cpu":
        from llmserve.engine.backends.cpu.backend import CpuBackend

        return CpuBackend(loaded, config)
    if device == "cuda" and config.cuda_graphs:
        from llmserve.engine.backends.cuda import CudaBackend

        return CudaBackend(loaded, config, max_model_len)
    from llmserve.engine.backends.torch_paged import TorchPagedBackend

    return TorchPagedBackend(loaded, config)
