# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (a Triton kernel's parameters are pointers and constexprs that no Python type describes)
"""Varlen paged attention in Triton: every sequence of a step, prompt chunks and decodes alike, in one launch.

Each program takes one sequence, one kv head and a block of that sequence's new tokens. The query heads that
share the kv head (the GQA group) are stacked as rows next to the tokens, so a decode token's whole group
reads each key and value row once. The keys are read where they lie in the paged cache, through the block
table, BLOCK_N positions at a time, with an online softmax; a query at position p attends to positions
0..p (its own K/V was written into the cache before the call). Nothing depends on the context length but the
loop's trip count, so a CUDA graph captured for a batch size serves every context.

Layouts: q and out [tokens, heads, head_dim] (the step's packed tokens, sequence after sequence); k_cache
and v_cache [kv_heads, slots, head_dim] with slot = block * block_size + offset; query_start [seqs + 1] int32
(cumulative new-token counts), seq_lens [seqs] int32 (context length once the step is done), block_tables
[seqs, width] int32.

Tested on the CPU through Triton's interpreter (TRITON_INTERPRET=1) against a plain torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of one program: tokens x query heads of a group. tl.dot wants at least 16 on each side.
BLOCK_M = 16


@triton.jit
def _varlen_paged_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_kv_head,
    stride_kv_slot,
    stride_table,
    stride_o_tok,
    stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    tokens_per_block = BLOCK_M // GROUP
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    first = m_block * tokens_per_block
    if first < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        token = first + rows // GROUP  # the row's token, counted from the sequence's first new one
        head = kv_head * GROUP + rows % GROUP
        valid = (rows < tokens_per_block * GROUP) & (token < q_len)
        position = seq_len - q_len + token  # the row's position in the sequence
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + (q_start + token)[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # Causal: this block's last token attends to everything up to its own position.
        last = tl.minimum(q_len, first + tokens_per_block) - 1
        keys_end = seq_len - q_len + last + 1
        k_base = k_ptr + kv_head * stride_kv_head
        v_base = v_ptr + kv_head * stride_kv_head
        for start in range(0, keys_end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            in_range = cols < keys_end
            blocks = tl.load(tables_ptr + seq * stride_table + cols // BLOCK_SIZE, mask=in_range, other=0)
            slots = blocks.to(tl.int64) * BLOCK_SIZE + cols % BLOCK_SIZE
            k = tl.load(k_base + slots[None, :] * stride_kv_slot + dims[:, None], mask=in_range[None, :], other=0.0)
            scores = tl.dot(q, k) * scale
            attend = (cols[None, :] <= position[:, None]) & in_range[None, :]
            scores = tl.where(attend, scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            # Rows that see no key yet (padding rows) keep a finite reference, so exp() never sees -inf - -inf.
            safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
            p = tl.exp(scores - safe_top[:, None])
            alpha = tl.exp(top - safe_top)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slots[:, None] * stride_kv_slot + dims[None, :], mask=in_range[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            top = new_top
        acc = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(
            out_ptr + (q_start + token)[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None],
        )


def varlen_paged_attention(
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
) -> torch.Tensor:
    """Attention of every new token of a step over its sequence's paged context; see the module docstring.

    `max_query_len` bounds the grid (a graph captured for decode steps passes 1). Returns `out`
    ([tokens, heads, head_dim], q's dtype), allocated when not given.
    """
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    if heads != kv_heads * group or group > BLOCK_M:
        raise ValueError(f"{heads} query heads over {kv_heads} kv heads: groups of up to {BLOCK_M} supported")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim}: a power of two >= 16 is supported")
    if k_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("q and the caches need a contiguous head_dim")
    if out is None:
        out = torch.empty_like(q)
    seqs = seq_lens.shape[0]
    tokens_per_block = BLOCK_M // group
    grid = (seqs, triton.cdiv(max_query_len, tokens_per_block), kv_heads)
    _varlen_paged_attention[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=max(16, block_size),
    )
    return out
