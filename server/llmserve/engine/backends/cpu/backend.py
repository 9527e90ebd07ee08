"""The CPU backend: the generic paged backend plus what makes a forward fast on a CPU.

- Decode attention reads the paged cache in place through a compiled kernel (native.PagedDecode); without
  it, decode rows are gathered in groups of similar length, so that padding wastes at most ~1/3 of a group.
- Long prompt chunks attend in blocks of QUERY_BLOCK query rows, each to the keys up to its last query.
- float32 linears run on weights packed once for oneDNN (packed_linear).
- Llama-family models run the fused forward (fused_layers): q/k/v and gate/up as one linear each, norms,
  rotary and SiLU-and-multiply as single C passes.

The compiled parts are built at install time; `--cpu-kernels` says what happens without them.
"""

from __future__ import annotations

import array
import logging
from collections.abc import Sequence

import torch

from llmserve.engine.backends.attention import Chunk, DecodeGroup, NativeDecode, PagedBatch, QueryBlock, paged_attention
from llmserve.engine.backends.cpu import native, packed_linear
from llmserve.engine.backends.cpu.fused_layers import FusedForward
from llmserve.engine.backends.torch_paged import TorchPagedBackend, padded_tables
from llmserve.engine.config import EngineConfig
from llmserve.models import LoadedModel

log = logging.getLogger(__name__)

# A long chunk's queries attend in blocks of this many rows, each to the keys up to its last query.
# transformers' CPU flash attention does nearly the full square's work under a causal mask; blocks skip
# most of the upper triangle. Measured (SmolLM2's heads, 464 queries after 16 cached tokens): one call
# 6.8 ms, blocks of 64 rows 5.1 ms; 128 and 256 rows fall in between.
QUERY_BLOCK = 64


class CpuBackend(TorchPagedBackend):
    """The generic backend with the compiled decode kernel, blocked chunk attention, packed linears and the
    fused Llama-family forward, each where it applies (see the module docstring)."""

    name = "cpu"

    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, num_blocks: int | None = None) -> None:
        super().__init__(loaded, config, num_blocks=num_blocks)
        self.varlen_kernel = None  # the CPU has its own decode kernel and blocked chunk attention
        model, s = loaded.model, self.shape
        kernels = native.usable(config.cpu_kernels)
        pack = config.packed_linear and packed_linear.available(self.device, self.dtype)
        self.kernel: native.PagedDecode | None = None
        if kernels and config.native_attention and self.dtype in native.PagedDecode.dtypes:
            self.kernel = native.load(s.head_dim, s.num_heads // s.num_kv_heads)
        self.fused: FusedForward | None = None
        if kernels and config.fused_layers:
            self.fused = FusedForward.build(model, native.load_fused(), pack, paged_attention)
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

    def native_decode(self, tables: list[Sequence[int]], lens: list[int]) -> NativeDecode | None:
        if self.kernel is None:
            return None
        width = max(len(t) for t in tables)
        return NativeDecode(
            kernel=self.kernel,
            num=len(lens),
            tables=padded_tables(tables, width, 0, torch.int32),  # padding is never read past a length
            lens=torch.frombuffer(array.array("i", lens), dtype=torch.int32),
            max_len=max(lens),
            block_size=self.block_size,
        )

    def decode_groups(self, tables: list[Sequence[int]], lens: list[int]) -> list[DecodeGroup]:
        """Decode rows (sorted by context length) in groups whose padding wastes at most ~1/3 of their reads."""
        groups: list[DecodeGroup] = []
        start, n = 0, len(lens)
        while start < n:
            end = start + 1
            while end < n and lens[end] * 2 <= lens[start] * 3 + 2 * self.block_size:
                end += 1
            ctx = max(lens[start:end])
            slots, bias = self.decode_tensors(tables[start:end], lens[start:end], ctx)
            groups.append(DecodeGroup(start, end, slots, bias, ctx))
            start = end
        return groups

    def chunk(self, q_start: int, q_end: int, ctx_start: int, table: Sequence[int]) -> Chunk:
        if q_end - q_start <= QUERY_BLOCK:
            return super().chunk(q_start, q_end, ctx_start, table)
        ctx = ctx_start + (q_end - q_start)
        context = self.context_slots(table, ctx) if ctx_start > 0 else None
        return Chunk(q_start, q_end, context, None, self.query_blocks(ctx_start, ctx))

    def query_blocks(self, ctx_start: int, ctx: int) -> list[QueryBlock]:
        """The queries of positions [ctx_start, ctx) in blocks of QUERY_BLOCK rows, each with its mask."""
        positions = torch.arange(ctx)
        blocks = []
        for start in range(0, ctx - ctx_start, QUERY_BLOCK):
            end = min(ctx - ctx_start, start + QUERY_BLOCK)
            keys = ctx_start + end
            hidden = positions[None, :keys] > positions[ctx_start + start : keys, None]
            # Additive, in the model's dtype: a boolean mask is converted on every call, in every layer.
            mask = torch.zeros(end - start, keys, dtype=self.dtype).masked_fill_(hidden, float("-inf"))
            blocks.append(QueryBlock(start, end, keys, mask))
        return blocks

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | None, batch: PagedBatch
    ) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(input_ids, position_ids, keep, batch)
        return super().forward(input_ids, position_ids, keep, batch)
