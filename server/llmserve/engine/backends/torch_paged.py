"""The generic backend: any transformers causal LM, CPU or CUDA, through the paged attention function.

It holds the paged step's collaborators (paged.py), built once with its choices: the KV cache (sized and allocated
before, `create_backend`), the persistent input batch (input_batch.py), a packer that stages each step for its
kernel (the Triton varlen kernel's device buffers, step_buffers.py, or the torch attention's gathered metadata,
metadata.py), LoRA slots applied through hooks (lora_slots.py), transformers' own forward, and the step that samples,
pools and keeps each sequence's state between steps.
"""

from __future__ import annotations

import torch

from llmserve.engine.backends.attention import ATTN_IMPLEMENTATION, VarlenKernel, register_attention
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.lora_slots import BackendLora
from llmserve.engine.backends.metadata import GatheredBuilder
from llmserve.engine.backends.paged import Packer, TransformersForward, paged_inputs, paged_step
from llmserve.engine.backends.step_buffers import StepBuffers
from llmserve.engine.config import EngineConfig
from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sample.streams import StreamMark
from llmserve.engine.sched.plan import Pooled, StepPlan
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.model import LoadedModel


class TorchPagedBackend:
    """Owns the model, the KV cache and the paged step's parts; `execute` runs one packed forward per plan and
    samples its rows."""

    name = "torch"

    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv: KVCache, max_model_len: int) -> None:
        model = loaded.model
        self.model = model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.kv = kv
        self.num_blocks = kv.num_blocks
        register_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.inputs = paged_inputs(config, kv, max_model_len, self.device)
        self.varlen_kernel = varlen_kernel(config.attention_kernel, self.device)
        # The varlen kernel's steps read persistent device buffers; the torch attention's, a builder's metadata.
        self.steps: StepBuffers | None = None
        if self.varlen_kernel is not None:
            self.steps = StepBuffers(self.inputs, kv, self.varlen_kernel, config.max_num_batched_tokens)
        # LoRA slots (None unless the config serves adapters), applied by hooks on the model's projections.
        self.lora = BackendLora.of(config, loaded.shape, model, self.dtype, self.device, fused=False)
        self.forward = TransformersForward(model, self.lora)
        attention = GatheredBuilder(self.inputs, kv, self.dtype)
        self.packer = Packer(self.inputs, attention, self.lora, self.device, steps=self.steps)
        self.paged = paged_step(loaded, kv, self.packer, self.forward, self.lora)
        kind = "one Triton varlen kernel" if self.varlen_kernel is not None else "torch"
        self.description = f"transformers layers, paged attention in {kind}"

    def execute(self, plan: StepPlan) -> list[Sampled | RowFailed | Pooled]:
        return self.paged.execute(plan)

    def release(self, sequence: int) -> None:
        self.paged.release(sequence)

    def mark_stream(self, row: SampleRow) -> StreamMark:
        return self.paged.mark_stream(row)

    def rewind_stream(self, sequence: int, seed: int, draws: int) -> None:
        self.paged.rewind_stream(sequence, seed, draws)


def varlen_kernel(choice: str, device: torch.device) -> VarlenKernel | None:
    """The Triton varlen kernel when `choice` asks for it ("triton", or "auto" on CUDA) and Triton imports;
    None for the torch path. "triton" without Triton raises."""
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return None
    try:
        from llmserve.engine.backends.triton_attention import varlen_paged_attention
    except ImportError as exc:
        if choice == "triton":
            raise RuntimeError(f"--attention-kernel triton: Triton is not installed ({exc})") from exc
        return None
    return varlen_paged_attention
