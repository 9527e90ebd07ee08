"""The backends' attention metadata: prompt-chunk attention equals plain causal attention over the whole context,
and block copies copy whole blocks."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.attention import GatheredAttention, paged_attention
from llmserve.engine.backends.cpu.backend import QUERY_BLOCK
from llmserve.engine.config import EngineConfig
from llmserve.models.loader import from_config
from tests.testing import tiny_config


@pytest.mark.parametrize(("cached", "length"), [(0, 3 * QUERY_BLOCK + 5), (37, 2 * QUERY_BLOCK), (200, 17)])
def test_chunk_attention_equals_causal_attention(cached: int, length: int) -> None:
    """A chunk of `length` new tokens after `cached` ones whose keys/values are already in the cache, at
    slots scattered over the pool: block-by-block attention (long chunks) equals one causal attention."""
    heads, kv_heads, dim, block_size = 4, 2, 16, 16
    config = EngineConfig(block_size=block_size, kv_cache_tokens=64 * block_size)
    runner = create_backend(from_config(tiny_config(), dtype=torch.float64), config, kind="cpu")
    g = torch.Generator().manual_seed(cached + length)
    total = cached + length
    table = torch.randperm(64, generator=g)[: -(-total // block_size)].tolist()
    chunk = runner.chunks.chunk(0, length, cached, table)
    assert (chunk.blocks is not None) == (length > QUERY_BLOCK)
    keys = torch.randn(kv_heads, total, dim, generator=g, dtype=torch.float64)
    values = torch.randn(kv_heads, total, dim, generator=g, dtype=torch.float64)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(total)])
    runner.kv.tensor[0, 0][:, slots[:cached]] = keys[:, :cached]
    runner.kv.tensor[0, 1][:, slots[:cached]] = values[:, :cached]
    query = torch.randn(1, heads, length, dim, generator=g, dtype=torch.float64)
    batch = GatheredAttention(kv=runner.kv.tensor, slot_mapping=slots[cached:], decode=[], chunks=[chunk])
    layer = types.SimpleNamespace(layer_idx=0)
    out, _ = paged_attention(layer, query, keys[None, :, cached:], values[None, :, cached:], None, llmserve_batch=batch)
    causal = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]
    expected = F.scaled_dot_product_attention(query, keys[None], values[None], attn_mask=causal, enable_gqa=True)
    assert torch.allclose(out[0], expected[0].transpose(0, 1), atol=1e-12)


def test_copy_blocks_copies_every_layers_keys_and_values_and_nothing_else() -> None:
    backend = create_backend(
        from_config(tiny_config(), dtype=torch.float64), EngineConfig(block_size=4, kv_cache_tokens=32)
    )
    kv = backend.kv.tensor
    kv.copy_(torch.randn(kv.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    before = kv.clone()
    backend.kv.copy_blocks([(2, 5), (6, 0)])

    def block(kv: torch.Tensor, b: int) -> torch.Tensor:  # every layer, K and V, every kv head
        return kv[:, :, :, b * 4 : (b + 1) * 4]

    assert torch.equal(block(kv, 5), block(before, 2)) and torch.equal(block(kv, 0), block(before, 6))
    for b in (1, 2, 3, 4, 6, 7, 8):  # 8: the scratch block
        assert torch.equal(block(kv, b), block(before, b))
