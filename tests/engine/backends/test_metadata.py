"""Attention metadata (backends/metadata.py, the types in attention.py): one type per kernel, carrying only what
its kernel reads, and the same attention from each for the same step; the KV cache sized once, before the
backend is built (base.kv_blocks)."""

from __future__ import annotations

import random
import types
from dataclasses import dataclass, fields, replace

import pytest
import torch

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.attention import GatheredAttention, KernelDecodeAttention, paged_attention
from llmserve.engine.backends.base import kv_blocks
from llmserve.engine.config import EngineConfig
from llmserve.engine.sched.plan import SeqStep, StepPlan
from llmserve.models.loader import from_config
from tests.testing import tiny_config

BS = 16


@dataclass
class _Seq:
    seq_no: int


def mixed_plan(rng: random.Random, num_blocks: int) -> StepPlan:
    """Decodes of assorted contexts and prompt chunks (with and without cached context, one longer than a query
    block), on scattered blocks."""
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    seqs = []
    shapes = [(37, 1), (300, 1), (5, 1), (70, 1), (0, 130), (40, 20), (0, 9), (200, 1)]
    for seq_no, (start, n) in enumerate(shapes):
        table = [blocks.pop() for _ in range((start + n - 1) // BS + 1)]
        ids = [rng.randrange(500) for _ in range(n)]
        seqs.append(SeqStep(_Seq(seq_no), start, ids, table, None))  # type: ignore[arg-type]
    return StepPlan(seqs=seqs)


def test_each_kernels_metadata_gives_the_same_attention() -> None:
    """The compiled decode kernel's metadata and the gathered torch metadata, for one mixed step over the same
    cache: the same output, each in its own type."""
    loaded = from_config(tiny_config(), dtype=torch.float64)
    config = EngineConfig(block_size=BS, kv_cache_tokens=128 * BS, max_num_seqs=8)
    kernel = create_backend(loaded, config, 2048)
    gathered = create_backend(loaded, replace(config, native_attention=False), 2048)
    if getattr(kernel, "kernel", None) is None:
        pytest.skip("the compiled decode kernel is not installed")
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(gathered.kv.tensor.shape, dtype=torch.float64, generator=g)
    rng = random.Random(2)
    plan = mixed_plan(rng, 128)
    outs = []
    for backend, kind in ((kernel, KernelDecodeAttention), (gathered, GatheredAttention)):
        backend.kv.tensor.copy_(cache)
        packed = backend.packer.prepare(plan)  # type: ignore[attr-defined]
        ids, meta = packed.input_ids, packed.batch
        assert type(meta) is kind
        tokens = ids.shape[1]
        q = torch.randn(1, 4, tokens, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        k = torch.randn(1, 2, tokens, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        v = torch.randn(1, 2, tokens, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        out, _ = paged_attention(types.SimpleNamespace(layer_idx=1), q, k, v, None, llmserve_batch=meta)
        outs.append(out)
    assert torch.allclose(outs[0], outs[1], atol=1e-12)
    # Only their own kernel's fields: no optional modes left unset.
    assert {f.name for f in fields(KernelDecodeAttention)} >= {"kernel", "tables", "lens", "chunks"}
    assert "kernel" not in {f.name for f in fields(GatheredAttention)}


def test_kv_is_sized_once_from_the_config_and_the_shape() -> None:
    loaded = from_config(tiny_config(), dtype=torch.float32)
    shape = loaded.shape
    by_tokens = EngineConfig(block_size=BS, kv_cache_tokens=1000)
    assert kv_blocks(by_tokens, shape, torch.float32, loaded.device) == 63  # ceil(1000 / 16)
    by_budget = EngineConfig(block_size=BS, cpu_kv_cache_bytes=1 << 20, kv_cache_memory_fraction=0.5)
    per_block = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4 * BS
    assert kv_blocks(by_budget, shape, torch.float32, loaded.device) == (1 << 19) // per_block
    backend = create_backend(loaded, by_tokens)
    # The pool's blocks and one scratch block, allocated at that size.
    assert backend.num_blocks == backend.kv.num_blocks == 63
    assert backend.kv.tensor.shape == (shape.num_layers, 2, shape.num_kv_heads, 64 * BS, shape.head_dim)
