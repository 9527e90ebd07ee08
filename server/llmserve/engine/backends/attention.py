"""Attention over the paged KV cache, as a transformers attention function, and the per-step metadata it reads.

The model is an unmodified transformers `AutoModelForCausalLM`. Its attention modules call the function
registered under `ATTN_IMPLEMENTATION` (transformers' AttentionInterface), which writes the step's new
keys/values into the paged cache (at the metadata's `slot_mapping`) and hands the attention itself to the
step's metadata. Every scheduled token of every sequence is packed into one row (batch size 1, explicit
position ids), so a step is one forward whatever the mix of prompt chunks and single decode tokens. A backend
builds one metadata object per step (metadata.py, from the persistent input batch); every layer reads it.

One metadata type per attention kernel, each with only the fields its kernel reads:
- `GatheredAttention` (torch): one-token (decode) queries gather their slots (index_select on a
  [kv_heads, slots, dim] cache) into one padded batched matmul per `DecodeGroup`; multi-token chunks gather
  their context and attend one sequence at a time with SDPA (on the CPU in blocks of query rows).
- `KernelDecodeAttention` (the CPU backend's compiled kernel): decode queries read each sequence's blocks in
  place through the kernel (cpu/native.PagedDecode); chunks as above.
- `VarlenAttention` (backends/triton_attention.py): every token of the step, chunks and decodes, in one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

if TYPE_CHECKING:
    from llmserve.engine.backends.cpu.native import PagedDecode

ATTN_IMPLEMENTATION = "llmserve_paged"


@dataclass(slots=True)
class QueryBlock:
    """Rows [start, end) of a chunk's queries, attending to the chunk's first `keys` context slots."""

    start: int
    end: int
    keys: int
    mask: torch.Tensor  # [end - start, keys] additive: 0 where attending, -inf elsewhere


@dataclass(slots=True)
class Chunk:
    """A multi-token query range [start, end) of the packed row and the cache slots of its whole context."""

    start: int
    end: int
    context_slots: torch.Tensor | None  # None: the chunk is the whole context (nothing cached before it)
    mask: torch.Tensor | None  # [q, ctx] True where attending; None for the plain causal mask, or with blocks
    blocks: list[QueryBlock] | None = None  # CPU, long chunks: attend block by block (see QUERY_BLOCK)


@dataclass(slots=True)
class DecodeGroup:
    """One-token queries [start, end) of the packed row whose contexts are gathered as one padded batch."""

    start: int
    end: int
    slots: torch.Tensor  # [(end - start) * ctx] flattened, padded with the scratch slot
    bias: torch.Tensor  # [kv_heads * (end - start), 1, ctx]: 0 where attending, -inf on padding
    ctx: int


class VarlenKernel(Protocol):
    """Attention of every new token of a step over its sequence's paged context, in one call
    (backends/triton_attention.varlen_paged_attention)."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        max_query_len: int,
        block_size: int,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class AttentionMetadata(Protocol):
    """What every layer reads of a step: the cache, where the new tokens' K/V go, and how to attend."""

    kv: torch.Tensor  # [layers, 2, kv_heads, slots, head_dim]
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V goes

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
    ) -> torch.Tensor:
        """query [1, H, T, D], key/value [1, KVH, T, D] of the packed row (already in the cache): [T, H, D]."""
        ...


@dataclass(slots=True)
class GatheredAttention:
    """Torch attention: decode rows (first in the packed row, grouped by context length) as gathered padded
    batches, then each chunk with SDPA."""

    kv: torch.Tensor
    slot_mapping: torch.Tensor
    decode: list[DecodeGroup]
    chunks: list[Chunk]

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
    ) -> torch.Tensor:
        out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
        k_cache, v_cache = self.kv[layer]
        for group in self.decode:
            _gathered_decode(group, query, k_cache, v_cache, scale, out)
        _attend_chunks(self.chunks, query, key, value, k_cache, v_cache, scale, out)
        return out


@dataclass(slots=True)
class KernelDecodeAttention:
    """The CPU kernel for the one-token queries [0, num) of the packed row (their block tables and context
    lengths), then each chunk with SDPA."""

    kv: torch.Tensor
    slot_mapping: torch.Tensor
    kernel: PagedDecode
    num: int
    tables: torch.Tensor  # [num, max blocks] int32 (entries past a length are never read)
    lens: torch.Tensor  # [num] int32
    max_len: int
    block_size: int
    chunks: list[Chunk]

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
    ) -> torch.Tensor:
        out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
        k_cache, v_cache = self.kv[layer]
        if self.num:
            q = query[0, :, : self.num].transpose(0, 1)  # [num, H, D]
            self.kernel(
                q, k_cache, v_cache, self.tables, self.lens, self.max_len, self.block_size, scale, out[: self.num]
            )
        _attend_chunks(self.chunks, query, key, value, k_cache, v_cache, scale, out)
        return out


@dataclass(slots=True)
class VarlenAttention:
    """Every sequence of the step for a VarlenKernel: its new tokens are rows [query_start[i],
    query_start[i + 1]) of the packed row, its context is seq_lens[i] tokens in block_tables[i]."""

    kv: torch.Tensor
    slot_mapping: torch.Tensor
    kernel: VarlenKernel
    query_start: torch.Tensor  # [seqs + 1] int32
    seq_lens: torch.Tensor  # [seqs] int32
    block_tables: torch.Tensor  # [seqs, width] int32
    max_query_len: int
    block_size: int

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv[layer]
        q = query[0].transpose(0, 1)  # [tokens, H, D]
        return self.kernel(
            q,
            k_cache,
            v_cache,
            self.query_start,
            self.seq_lens,
            self.block_tables,
            self.max_query_len,
            self.block_size,
            scale,
        )


def paged_attention(
    module: Any,  # the model's attention module: its layer_idx says which layer's cache
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    llmserve_batch: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over the paged cache. query [1, H, T, D], key/value [1, KVH, T, D].

    Under torch.compile (piecewise.py) it is opaque: the graph breaks here, the pieces between the layers'
    attention calls are compiled, and the cache write and the kernel run as they do eagerly (traced, the cache
    write would become a copy of the whole cache)."""
    if torch.compiler.is_compiling():
        opaque: tuple[torch.Tensor, None] = _opaque_attention(module, query, key, value, scaling, llmserve_batch)
        return opaque
    return _paged_attention(module, query, key, value, scaling, llmserve_batch)


def _paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    llmserve_batch: AttentionMetadata | None,
) -> tuple[torch.Tensor, None]:
    meta = llmserve_batch
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the llmserve_batch argument")
    scale = query.shape[3] ** -0.5 if scaling is None else scaling
    layer = module.layer_idx
    k_cache, v_cache = meta.kv[layer]
    k_cache.index_copy_(1, meta.slot_mapping, key[0])
    v_cache.index_copy_(1, meta.slot_mapping, value[0])
    return meta.attend(query, key, value, layer, scale)[None], None


_opaque_attention = torch.compiler.disable(_paged_attention)  # type: ignore[no-untyped-call]


def _gathered_decode(
    group: DecodeGroup,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    _, num_heads, _, head_dim = query.shape
    num_kv_heads = k_cache.shape[0]
    nd, ctx, g = group.end - group.start, group.ctx, num_heads // num_kv_heads
    keys = k_cache.index_select(1, group.slots).view(num_kv_heads * nd, ctx, head_dim)
    values = v_cache.index_select(1, group.slots).view(num_kv_heads * nd, ctx, head_dim)
    # [H, nd, D] -> [KVH * nd, group, D]: batch over (kv head, sequence), the group's heads as rows.
    q = query[0, :, group.start : group.end].reshape(num_kv_heads, g, nd, head_dim).transpose(1, 2)
    q = q.reshape(num_kv_heads * nd, g, head_dim)
    scores = torch.baddbmm(group.bias, q, keys.transpose(1, 2), alpha=scale)
    if scores.dtype in (torch.float16, torch.bfloat16):
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    else:
        probs = torch.softmax(scores, dim=-1)
    o = torch.bmm(probs, values).view(num_kv_heads, nd, g, head_dim)
    out[group.start : group.end] = o.transpose(0, 1).reshape(nd, num_heads, head_dim)


def _attend_chunks(
    chunks: list[Chunk],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    for chunk in chunks:
        q = query[:, :, chunk.start : chunk.end]
        if chunk.context_slots is None:
            k = key[:, :, chunk.start : chunk.end]
            v = value[:, :, chunk.start : chunk.end]
        else:
            k = k_cache.index_select(1, chunk.context_slots)[None]
            v = v_cache.index_select(1, chunk.context_slots)[None]
        if chunk.blocks is None:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True
            )
            out[chunk.start : chunk.end] = o[0].transpose(0, 1)
            continue
        for block in chunk.blocks:
            o = F.scaled_dot_product_attention(
                q[:, :, block.start : block.end],
                k[:, :, : block.keys],
                v[:, :, : block.keys],
                attn_mask=block.mask,
                scale=scale,
                enable_gqa=True,
            )
            out[chunk.start + block.start : chunk.start + block.end] = o[0].transpose(0, 1)


def register_attention() -> None:
    """Make `paged_attention` available to transformers as ATTN_IMPLEMENTATION (idempotent). Called by the
    backends when they are built, not on import."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
