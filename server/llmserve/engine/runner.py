"""The model runner: owns the KV tensors and turns one scheduler output into one forward.

The model is an unmodified transformers `AutoModelForCausalLM`. Its attention modules call the function
registered here under `ATTN_IMPLEMENTATION` (transformers' AttentionInterface), which writes the step's
new keys/values into the paged cache and attends over each sequence's blocks. Every scheduled token of
every sequence is packed into one row (batch size 1, explicit position ids), so a step is one forward
whatever the mix of prompt chunks and single decode tokens.

Single-token (decode) queries: on the CPU a compiled kernel (native.py) reads each sequence's blocks in
place; elsewhere (CUDA, or where the kernel cannot be built) each sequence's slots are gathered
(index_select on a [kv_heads, slots, dim] cache) into one padded batched matmul per group. Multi-token
chunks gather their context and attend one sequence at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from llmserve.engine import native, packed_linear
from llmserve.engine.fused_layers import FusedForward
from llmserve.engine.request import Sequence

log = logging.getLogger(__name__)

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


@dataclass(slots=True)
class NativeDecode:
    """One-token queries [0, num) of the packed row, for the CPU kernel: block tables and context lengths."""

    kernel: native.PagedDecode
    num: int
    tables: torch.Tensor  # [num, max blocks] int32, padded with block 0 (never read past a length)
    lens: torch.Tensor  # [num] int32
    max_len: int
    block_size: int


@dataclass(slots=True)
class PagedBatch:
    """Per-step attention metadata, built once and read by every layer."""

    kv: torch.Tensor  # [layers, 2, kv_heads, slots, head_dim]
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V goes
    decode: list[DecodeGroup]  # one-token queries come first in the row, grouped by context length
    chunks: list[Chunk]
    native: NativeDecode | None = None  # replaces `decode` when the CPU kernel runs


def paged_attention(
    module: torch.nn.Module,
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


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


@dataclass(slots=True, frozen=True)
class KVShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: object) -> KVShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, heads, kv_heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Owns the model and the KV cache; `execute` runs one packed forward and returns the needed logits.

    The cache has one block more than the pool hands out: a scratch block that padded rows write to.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        *,
        cuda_graphs: bool = False,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        native_decode: bool = True,
        pack_linears: bool = True,
        fused_layers: bool = True,
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.shape = KVShape.of(model.config)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        s = self.shape
        slots = (num_blocks + 1) * block_size
        self.kv = torch.zeros(s.num_layers, 2, s.num_kv_heads, slots, s.head_dim, dtype=self.dtype, device=self.device)
        self.num_packed_linears = 0
        pack = pack_linears and packed_linear.available(self.device, self.dtype)
        self.fused = None
        if fused_layers and self.device.type == "cpu":
            self.fused = FusedForward.build(model, native.load_fused(), pack, paged_attention)
        if self.fused is not None:
            self.num_packed_linears = self.fused.num_packed
        elif pack:
            self.num_packed_linears = packed_linear.pack_linears(model)
        self.kernel = None
        if native_decode and self.device.type == "cpu" and self.dtype in native.PagedDecode.dtypes:
            self.kernel = native.load(s.head_dim, s.num_heads // s.num_kv_heads)
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            from llmserve.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy-on-write of a shared, partly filled block) in every layer."""
        bs = self.block_size
        for src, dst in copies:
            self.kv[:, :, :, dst * bs : (dst + 1) * bs] = self.kv[:, :, :, src * bs : (src + 1) * bs]

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], sample_seqs: list[Sequence]) -> torch.Tensor:
        """One forward over the scheduled tokens; returns logits [len(sample_seqs), vocab] (float32).

        `scheduled` must list one-token entries first (the runner batches their attention);
        `sample_seqs` are the scheduled sequences whose last scheduled token is their last token.
        """
        ids, positions, slots = [], [], []
        sample_index = {}
        chunks: list[Chunk] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        bs = self.block_size
        offset = 0
        for seq, n in scheduled:
            start = seq.num_computed
            end = start + n
            table = seq.block_table
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if end == len(seq.token_ids):
                sample_index[seq.request_id] = offset + n - 1
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                chunks.append(self._chunk(offset, offset + n, start, table))
            offset += n
        num_decode = len(decode_lens)
        all_decode = num_decode == len(ids) and len(sample_seqs) == num_decode
        if all_decode and self.graphs is not None and self.graphs.covers(num_decode, max(decode_lens)):
            try:
                logits = self.graphs.run(ids, positions, slots, decode_tables, decode_lens)
            except RuntimeError:
                # A model whose forward cannot be captured still serves, only without graphs.
                log.exception("CUDA graph capture/replay failed; decoding eagerly from now on")
                self.graphs = None
            else:
                rows = [sample_index[s.request_id] for s in sample_seqs]
                return logits[torch.tensor(rows, device=self.device)] if rows != list(range(len(rows))) else logits
        dev = self.device
        batch = PagedBatch(
            kv=self.kv, slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), decode=[], chunks=chunks
        )
        if self.kernel is not None and num_decode:
            batch.native = self._native_decode(decode_tables, decode_lens)
        else:
            batch.decode = self._decode_groups(decode_tables, decode_lens)
        keep = torch.tensor([sample_index[s.request_id] for s in sample_seqs], dtype=torch.long, device=dev)
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        position_ids = torch.tensor([positions], dtype=torch.long, device=dev)
        return self.forward(input_ids, position_ids, keep, batch)

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split decode rows (sorted by context length) so that padding wastes at most ~1/3 of a group's reads.

        Fewer, larger groups mean fewer kernel launches: on CUDA everything stays one group.
        """
        groups: list[DecodeGroup] = []
        start = 0
        n = len(lens)
        while start < n:
            end = start + 1
            if self.device.type == "cuda":
                end = n
            else:
                while end < n and lens[end] * 2 <= lens[start] * 3 + 2 * self.block_size:
                    end += 1
            ctx = max(lens[start:end])
            slots, bias = self.decode_tensors(tables[start:end], lens[start:end], ctx)
            groups.append(DecodeGroup(start, end, slots, bias, ctx))
            start = end
        return groups

    def _native_decode(self, tables: list[list[int]], lens: list[int]) -> NativeDecode:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return NativeDecode(
            kernel=self.kernel,
            num=len(lens),
            tables=torch.tensor(padded, dtype=torch.int32),
            lens=torch.tensor(lens, dtype=torch.int32),
            max_len=max(lens),
            block_size=self.block_size,
        )

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | None, batch: PagedBatch
    ) -> torch.Tensor:
        """The model on a packed row; logits of the `keep` positions (all when None) as float32."""
        if self.fused is not None:
            return self.fused(input_ids, position_ids, keep, batch)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=0 if keep is None else keep,
            llmserve_batch=batch,
        )
        return out.logits[0].float()

    def decode_tensors(self, tables: list[list[int]], lens: list[int], ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather slots [len(tables) * ctx] and additive mask [kv_heads * len(tables), 1, ctx] for decode rows."""
        bs = self.block_size
        dev = self.device
        width = -(-ctx // bs)
        scratch = self.scratch_block
        padded = [t[:width] + [scratch] * (width - min(len(t), width)) for t in tables]
        blocks = torch.tensor(padded, dtype=torch.long, device=dev)
        slots = (blocks[:, :, None] * bs + torch.arange(bs, device=dev)).view(len(tables), -1)[:, :ctx]
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        bias = torch.zeros(len(tables), ctx, dtype=self.dtype, device=dev)
        bias.masked_fill_(torch.arange(ctx, device=dev)[None, :] >= lens_t[:, None], float("-inf"))
        kvh = self.shape.num_kv_heads
        return slots.reshape(-1), bias.repeat(kvh, 1).view(kvh * len(tables), 1, ctx)

    def _chunk(self, q_start: int, q_end: int, ctx_start: int, table: list[int]) -> Chunk:
        bs = self.block_size
        ctx = ctx_start + (q_end - q_start)
        dev = self.device
        chunk = Chunk(q_start, q_end, None, None)
        if ctx_start > 0:
            blocks = torch.tensor(table[: -(-ctx // bs)], dtype=torch.long, device=dev)
            chunk.context_slots = (blocks[:, None] * bs + torch.arange(bs, device=dev)).view(-1)[:ctx]
        if dev.type == "cpu" and q_end - q_start > QUERY_BLOCK:
            chunk.blocks = self._query_blocks(ctx_start, ctx)
        elif ctx_start > 0:
            q_pos = torch.arange(ctx_start, ctx, device=dev)
            chunk.mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]
        return chunk

    def _query_blocks(self, ctx_start: int, ctx: int) -> list[QueryBlock]:
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
