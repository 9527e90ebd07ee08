"""The CPU backend: the generic paged backend plus what makes a forward fast on a CPU.

- Decode attention reads the paged cache in place through a compiled kernel (native.PagedDecode, with
  metadata.KernelDecodeBuilder); without it, decode rows are gathered in groups of similar length, so that
  padding wastes at most ~1/3 of a group (metadata.GatheredBuilder, grouped).
- Long prompt chunks attend in blocks of QUERY_BLOCK query rows, each to the keys up to its last query.
- float32 linears run on weights packed once for oneDNN (packed_linear).
- Llama-family models run the fused forward (fused_layers): q/k/v and gate/up as one linear each, norms,
  rotary and SiLU-and-multiply as single C passes.

The compiled parts are built at install time; `--cpu-kernels` says what happens without them.
"""

from __future__ import annotations

import logging

import torch

from llmserve.engine.backends.attention import AttentionMetadata, paged_attention
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.cpu import native, packed_linear
from llmserve.engine.backends.cpu.fused_layers import FusedForward
from llmserve.engine.backends.lora_slots import BackendLora
from llmserve.engine.backends.metadata import QUERY_BLOCK, GatheredBuilder, KernelDecodeBuilder
from llmserve.engine.backends.torch_paged import TorchPagedBackend
from llmserve.engine.config import EngineConfig
from llmserve.engine.lora.ops import LoraRows
from llmserve.models import LoadedModel

__all__ = ["QUERY_BLOCK", "CpuBackend"]

log = logging.getLogger(__name__)


class CpuBackend(TorchPagedBackend):
    """The generic backend with the compiled decode kernel, blocked chunk attention, packed linears and the
    fused Llama-family forward, each where it applies (see the module docstring)."""

    name = "cpu"

    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv: KVCache, max_model_len: int) -> None:
        super().__init__(loaded, config, kv, max_model_len)
        self.varlen_kernel = None  # the CPU has its own decode kernel and blocked chunk attention
        model, s = loaded.model, self.shape
        kernels = native.usable(config.cpu_kernels)
        pack = config.packed_linear and packed_linear.available(self.device, self.dtype)
        self.kernel: native.PagedDecode | None = None
        if kernels and config.native_attention and self.dtype in native.PagedDecode.dtypes:
            self.kernel = native.load(s.head_dim, s.group)
        self.chunks = GatheredBuilder(self.inputs, kv, self.dtype, grouped=True, query_blocks=True)
        self.attention = self.chunks
        if self.kernel is not None:
            self.attention = KernelDecodeBuilder(self.inputs, kv, self.kernel, self.chunks)
        self.fused: FusedForward | None = None
        if kernels and config.fused_layers:
            self.fused = FusedForward.build(model, native.load_fused(), pack, paged_attention, s)
        if self.fused is not None and self.lora is not None:  # the fused forward applies the slots itself
            self.lora.close()
            self.lora = BackendLora(config, s, model, self.dtype, self.device, fused=True)
        if self.fused is not None:
            self.num_packed_linears = self.fused.num_packed
        elif pack:
            self.num_packed_linears = packed_linear.pack_linears(model)
        else:
            self.num_packed_linears = 0
        parts = [
            "fused Llama-family forward" if self.fused is not None else "transformers layers",
            "compiled decode kernel" if self.kernel is not None else "decode attention in torch",
            f"{self.num_packed_linears} packed oneDNN linears" if self.num_packed_linears else "plain linears",
        ]
        self.description = ", ".join(parts)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None,
        batch: AttentionMetadata,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        if self.fused is not None:
            weights = None if lora is None or self.lora is None else self.lora.weights
            return self.fused(input_ids, position_ids, keep, batch, lora, weights)
        return super().forward(input_ids, position_ids, keep, batch, lora)
