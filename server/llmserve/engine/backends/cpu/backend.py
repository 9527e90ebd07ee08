"""The CPU backend: the paged step's parts (paged.py) with what makes a forward fast on a CPU.

- Decode attention reads the paged cache in place through a compiled kernel (native.PagedDecode, with
  metadata.KernelDecodeBuilder); without it, decode rows are gathered in groups of similar length, so that
  padding wastes at most ~1/3 of a group (metadata.GatheredBuilder, grouped).
- Long prompt chunks attend in blocks of QUERY_BLOCK query rows, each to the keys up to its last query.
- float32 linears run on weights packed once for oneDNN (packed_linear).
- Llama-family models run the fused forward (fused_layers): q/k/v and gate/up as one linear each, norms,
  rotary and SiLU-and-multiply as single C passes; in float32, bfloat16 (a bfloat16 model), int8 (`--dtype
  int8`) or from a GGUF's blocks (`--dtype gguf`, float32 rows: gguf_linear.py over quant.py). In all but float32
  every token's attention goes through the decode kernel, so that a token's result does not depend on the chunk or
  step that computed it (batch invariance; metadata.KernelDecodeBuilder).

The compiled parts are built at install time; `--cpu-kernels` says what happens without them. The description
(start-up log, GetModelInfo) names the precision, the kernel oneDNN runs for the linears (its instruction set)
and the CPU's level as cpu_features reads it.
"""

from __future__ import annotations

import logging

import torch

from llmserve import cpu_features
from llmserve.engine.backends.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    paged_attention,
    register_attention,
)
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.cpu import native, packed_linear, quant
from llmserve.engine.backends.cpu.fused_layers import FusedForward
from llmserve.engine.backends.cpu.step_program import StepProgram
from llmserve.engine.backends.lora_slots import BackendLora
from llmserve.engine.backends.metadata import QUERY_BLOCK, GatheredBuilder, KernelDecodeBuilder, MetadataBuilder
from llmserve.engine.backends.paged import ModelForward, Packed, Packer, TransformersForward, paged_inputs, paged_step
from llmserve.engine.config import EngineConfig
from llmserve.engine.lora.ops import LoraRows
from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sample.streams import StreamMark
from llmserve.engine.sched.plan import Pooled, StepPlan
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.adapters import LoraUnsupported
from llmserve.engine.types.model import LoadedModel

__all__ = ["QUERY_BLOCK", "CpuBackend"]

log = logging.getLogger(__name__)


class CpuBackend:
    """The paged step's parts with the compiled decode kernel, blocked chunk attention, packed linears and the
    fused Llama-family forward, each where it applies (see the module docstring)."""

    name = "cpu"

    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv: KVCache, max_model_len: int) -> None:
        # What --dtype refuses at load (models.resolve_dtype), refused here too for a model built otherwise: no
        # bfloat16 model quietly falls back to transformers' layers on a CPU without oneDNN's bfloat16 kernels.
        precision = loaded.weights if loaded.weights not in (None, "gguf") else str(loaded.dtype).removeprefix("torch.")
        refused = cpu_features.refusal(precision, cpu_features.cpu_level())
        if refused is not None:
            raise ValueError(refused)
        model, s = loaded.model, loaded.shape
        self.model = model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.kv = kv
        self.num_blocks = kv.num_blocks
        register_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        kernels = native.usable(config.cpu_kernels)
        pack = config.packed_linear and packed_linear.available(self.device, self.dtype)
        self.kernel: native.PagedDecode | None = None
        if kernels and config.native_attention and self.dtype in native.PagedDecode.dtypes:
            self.kernel = native.load(s.head_dim, s.group)
        self.fused: FusedForward | None = None
        if kernels and config.fused_layers:
            self.fused = FusedForward.build(
                model,
                native.load_fused(),
                pack,
                paged_attention,
                s,
                mixed=native.load_mixed(),
                weights=_weights(loaded),
                source=loaded.gguf,
                generates=loaded.generates,
            )
        # A GGUF's blocks also run in transformers' layers (gguf_linear.QuantProjection), only slower.
        if loaded.weights not in (None, "gguf") and self.fused is None:
            raise ValueError(
                f"--dtype {loaded.weights} needs the fused CPU forward (a Llama/Mistral/Qwen2/Qwen3 model, the CPU "
                "kernels installed, --no-fused-layers off)"
            )
        if self.fused is not None and config.lora_enabled and not self.fused.precision.float_rows:
            raise LoraUnsupported(
                f"--dtype {self.fused.precision.linears} with LoRA adapters (--lora/--enable-lora): the fused CPU "
                "forward adds adapter deltas in float32 only; serve adapters with --dtype float32"
            )
        # LoRA slots (None unless the config serves adapters): the fused forward applies them itself, transformers'
        # layers through hooks on their projections.
        self.lora = BackendLora.of(config, s, model, self.dtype, self.device, fused=self.fused is not None)
        self.inputs = paged_inputs(config, kv, max_model_len, self.device)
        self.chunks = GatheredBuilder(self.inputs, kv, self.dtype, grouped=True, query_blocks=True)
        attention: MetadataBuilder = self.chunks
        if self.kernel is not None:
            every = self.fused is not None and self.fused.precision.every_token
            attention = KernelDecodeBuilder(self.inputs, kv, self.kernel, self.chunks, every_token=every)
        self.attention = attention
        self.packer = Packer(self.inputs, attention, self.lora, self.device)
        self.forward: ModelForward
        if self.fused is not None:
            # A whole step over a GGUF's blocks in one C call, where the step fits it (step_program.py).
            program = StepProgram.build(self.fused, kv.tensor, self.kernel) if config.compiled_steps else None
            self.forward = FusedCpuForward(self.fused, program, self.lora)
        else:
            self.forward = TransformersForward(model, self.lora)
        self.paged = paged_step(loaded, kv, self.packer, self.forward, self.lora)
        if self.fused is not None:
            self.num_packed_linears = self.fused.num_packed
        elif pack:
            self.num_packed_linears = packed_linear.pack_linears(model)
        else:
            self.num_packed_linears = 0
        self.description = ", ".join(self._describe())

    @property
    def program(self) -> StepProgram | None:
        """The compiled step program the fused forward runs where a step fits it (None without one)."""
        return self.forward.program if isinstance(self.forward, FusedCpuForward) else None

    def execute(self, plan: StepPlan) -> list[Sampled | RowFailed | Pooled]:
        return self.paged.execute(plan)

    def release(self, sequence: int) -> None:
        self.paged.release(sequence)

    def mark_stream(self, row: SampleRow) -> StreamMark:
        return self.paged.mark_stream(row)

    def rewind_stream(self, sequence: int, seed: int, draws: int) -> None:
        self.paged.rewind_stream(sequence, seed, draws)

    def _describe(self) -> list[str]:
        fused, kernel = self.fused, self.kernel
        parts = ["transformers layers"]
        if fused is not None:
            p = fused.precision
            kinds = p.linears if p.head == p.linears else f"{p.linears} linears, {p.head} LM head"
            parts = [f"fused Llama-family forward ({kinds}, {str(p.residual).removeprefix('torch.')} residual)"]
        if kernel is None:
            parts.append("decode attention in torch")
        else:
            every = isinstance(self.attention, KernelDecodeBuilder) and self.attention.every_token
            cache = str(self.kv.tensor.dtype).removeprefix("torch.")
            parts.append(f"compiled decode kernel over a {cache} KV cache{' for every token' if every else ''}")
        if fused is not None and fused.precision.linears.startswith("gguf"):
            parts.append(_describe_blocks(fused))
        elif self.num_packed_linears:
            implementation = fused.onednn_kernel() if fused is not None else None
            parts.append(
                f"{self.num_packed_linears} packed oneDNN linears" + (f" ({implementation})" if implementation else "")
            )
        else:
            parts.append("plain linears")
        parts.append(f"CPU {cpu_features.cpu_level()}")
        return parts


class FusedCpuForward:
    """The fused Llama-family forward on a packed row (a `ModelForward`): the compiled step program where the step
    fits it, else the fused layers from Python; LoRA deltas from `lora`'s slots, which the fused layers add
    themselves."""

    def __init__(self, fused: FusedForward, program: StepProgram | None, lora: BackendLora | None) -> None:
        self.fused = fused
        self.program = program
        self.lora = lora

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None,
        batch: AttentionMetadata,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        if self.program is not None and self.program.fits(batch, lora, input_ids.shape[1]):
            return self.program.run(input_ids, position_ids, keep, batch)
        weights = None if lora is None or self.lora is None else self.lora.weights
        return self.fused.run(input_ids, position_ids, keep, batch, lora, weights)[0]

    def pooled(self, packed: Packed, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = None if packed.lora is None or self.lora is None else self.lora.weights
        logits, hidden = self.fused.run(
            packed.input_ids, packed.positions, packed.keep, packed.batch, packed.lora, weights, pool
        )
        assert hidden is not None
        return logits, hidden


def _weights(loaded: LoadedModel) -> str | None:
    """The fused forward's weights: "gguf-float32" for a GGUF's blocks with float32 activations."""
    return "gguf-float32" if loaded.weights == "gguf" and loaded.activations == "float32" else loaded.weights


def _describe_blocks(fused: FusedForward) -> str:
    """How many kernel calls of each block type a forward makes, and the kernels' level."""
    kinds: dict[str, int] = {}
    for linear in fused.linears():
        for kind in getattr(linear, "kinds", ()):
            kinds[kind.name] = kinds.get(kind.name, 0) + 1
    counts = ", ".join(f"{n} {name}" for name, n in sorted(kinds.items(), key=lambda item: -item[1]))
    activations = "float32" if fused.precision.linears == "gguf-float32" else "int8"
    return f"linears from the GGUF's blocks ({counts}; {quant.kernel_level()} kernels, {activations} activations)"
