"""Attention over the paged KV cache, as a transformers attention function, and the per-step metadata it reads.

The model is an unmodified transformers `AutoModelForCausalLM`. Its attention modules call the function
registered under `ATTN_IMPLEMENTATION` (transformers' AttentionInterface), which writes the step's new
keys/values into the paged cache and attends over each sequence's blocks. Every scheduled token of every
sequence is packed into one row (batch size 1, explicit position ids), so a step is one forward whatever the
mix of prompt chunks and single decode tokens. The backends build a `PagedBatch` once per step; every layer
reads it.

Single-token (decode) queries: a `DecodeKernel` reads each sequence's blocks in place (the CPU backend's
compiled kernel), or each sequence's slots are gathered (index_select on a [kv_heads, slots, dim] cache) into
one padded batched matmul per `DecodeGroup`. Multi-token chunks gather their context and attend one sequence at
a time (on the CPU in blocks of query rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "llmserve_paged"

# CPU: a long chunk's queries attend in blocks of this many rows, each to the keys up to its last query.
# transformers' CPU flash attention does nearly the full square's work under a causal mask; blocks skip
# most of the upper triangle. Measured (SmolLM2's heads, 464 queries after 16 cached tokens): one call
# 6.8 ms, blocks of 64 rows 5.1 ms; 128 and 256 rows fall in between.
QUERY_BLOCK = 64


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


class DecodeKernel(Protocol):
    """Decode attention that reads the paged cache in place (the CPU backend's compiled kernel)."""

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        max_len: int,
        block_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None: ...


@dataclass(slots=True)
class NativeDecode:
    """One-token queries [0, num) of the packed row, for a DecodeKernel: block tables and context lengths."""

    kernel: DecodeKernel
    num: int
    tables: torch.Tensor  # [num, max blocks] int32, padded with block 0 (never read past a length)
    lens: torch.Tensor  # [num] int32
    max_len: int
    block_size: int


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


@dataclass(slots=True)
class Varlen:
    """Every sequence of the step for a VarlenKernel: its new tokens are rows [query_start[i],
    query_start[i + 1]) of the packed row, its context is seq_lens[i] tokens in block_tables[i]."""

    kernel: VarlenKernel
    query_start: torch.Tensor  # [seqs + 1] int32
    seq_lens: torch.Tensor  # [seqs] int32
    block_tables: torch.Tensor  # [seqs, width] int32
    max_query_len: int
    block_size: int


@dataclass(slots=True)
class PagedBatch:
    """Per-step attention metadata, built once and read by every layer."""

    kv: torch.Tensor  # [layers, 2, kv_heads, slots, head_dim]
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V goes
    decode: list[DecodeGroup]  # one-token queries come first in the row, grouped by context length
    chunks: list[Chunk]
    native: NativeDecode | None = None  # replaces `decode` when the CPU kernel runs
    varlen: Varlen | None = None  # replaces `decode`, `native` and `chunks`: one kernel for every token


def paged_attention(
    module: Any,  # the model's attention module: its layer_idx says which layer's cache
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    llmserve_batch: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over the paged cache. query [1, H, T, D], key/value [1, KVH, T, D]."""
    batch = llmserve_batch
    if batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the llmserve_batch argument")
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    scale = head_dim**-0.5 if scaling is None else scaling
    k_cache, v_cache = batch.kv[module.layer_idx]
    k_new, v_new = key[0], value[0]
    k_cache.index_copy_(1, batch.slot_mapping, k_new)
    v_cache.index_copy_(1, batch.slot_mapping, v_new)

    if batch.varlen is not None:
        vl = batch.varlen
        q = query[0].transpose(0, 1)  # [tokens, H, D]
        out = vl.kernel(
            q, k_cache, v_cache, vl.query_start, vl.seq_lens, vl.block_tables, vl.max_query_len, vl.block_size, scale
        )
        return out[None], None

    out = query.new_empty(num_tokens, num_heads, head_dim)
    group = num_heads // num_kv_heads
    nat = batch.native
    if nat is not None:
        q = query[0, :, : nat.num].transpose(0, 1)  # [num, H, D]
        nat.kernel(q, k_cache, v_cache, nat.tables, nat.lens, nat.max_len, nat.block_size, scale, out[: nat.num])
    for dg in batch.decode:
        nd, ctx = dg.end - dg.start, dg.ctx
        keys = k_cache.index_select(1, dg.slots).view(num_kv_heads * nd, ctx, head_dim)
        values = v_cache.index_select(1, dg.slots).view(num_kv_heads * nd, ctx, head_dim)
        # [H, nd, D] -> [KVH * nd, group, D]: batch over (kv head, sequence), the group's heads as rows.
        q = query[0, :, dg.start : dg.end].reshape(num_kv_heads, group, nd, head_dim).transpose(1, 2)
        q = q.reshape(num_kv_heads * nd, group, head_dim)
        scores = torch.baddbmm(dg.bias, q, keys.transpose(1, 2), alpha=scale)
        if scores.dtype in (torch.float16, torch.bfloat16):
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.bmm(probs, values).view(num_kv_heads, nd, group, head_dim)
        out[dg.start : dg.end] = o.transpose(0, 1).reshape(nd, num_heads, head_dim)
    for chunk in batch.chunks:
        q = query[:, :, chunk.start : chunk.end]
        if chunk.context_slots is None:
            k = k_new[None, :, chunk.start : chunk.end]
            v = v_new[None, :, chunk.start : chunk.end]
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
    return out[None], None


def register_attention() -> None:
    """Make `paged_attention` available to transformers as ATTN_IMPLEMENTATION (idempotent). Called by the
    backends when they are built, not on import."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
