"""The CUDA backend's start (backends/cuda.py), on the CPU emulation (capture=False, the varlen kernel through
Triton's interpreter): the graphs' memory is estimated from one eager forward of the largest bucket before the KV
cache is sized, nothing is built twice, and each bucket's graph is prepared once, over the final cache."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.base import kv_blocks
from llmserve.engine.backends.cuda import CudaBackend, DecodeGraphs
from llmserve.engine.backends.paged import TransformersForward
from llmserve.engine.config import EngineConfig
from llmserve.models.loader import from_config
from tests.testing import TINY_VOCAB, tiny_config

pytest.importorskip("triton", reason="the CUDA backend's graphs are built on the Triton varlen kernel")


def test_a_cuda_start_estimates_the_graphs_once_and_builds_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = from_config(tiny_config(), dtype=torch.float32)
    config = EngineConfig(
        block_size=16, kv_cache_tokens=None, cpu_kv_cache_bytes=1 << 22, max_num_seqs=8, attention_kernel="triton"
    )
    events: list[str] = []
    forwards: Counter[int] = Counter()
    builds: Counter[tuple[int, int]] = Counter()
    kvs: list[int] = []
    real_forward, real_build, real_init = TransformersForward.logits, DecodeGraphs._build, CudaBackend.__init__

    def forward(self, input_ids, position_ids, keep, batch):  # noqa: ANN001, ANN202
        forwards[input_ids.shape[1]] += 1
        blocks = batch.kv.shape[3] // batch.block_size - 1  # the cache's blocks, its scratch block left out
        events.append(f"forward {input_ids.shape[1]} over {blocks} blocks")
        return real_forward(self, input_ids, position_ids, keep, batch)

    def build(self, bp):  # noqa: ANN001, ANN202
        builds[id(self), bp] += 1
        events.append(f"build {bp} over {self.steps.kv.num_blocks} blocks")
        return real_build(self, bp)

    def init(self, loaded, config, kv, max_model_len, **kw):  # noqa: ANN001, ANN202
        kvs.append(kv.num_blocks)
        events.append(f"backend over {kv.num_blocks} blocks")
        real_init(self, loaded, config, kv, max_model_len, **kw)

    monkeypatch.setattr(TransformersForward, "logits", forward)
    monkeypatch.setattr(DecodeGraphs, "_build", build)
    monkeypatch.setattr(CudaBackend, "__init__", init)
    backend = create_backend(loaded, config, 256, kind="cuda", capture=False)

    assert isinstance(backend, CudaBackend)
    buckets = backend.graphs.buckets
    assert buckets == (1, 2, 4, 8)
    # One forward, the largest bucket's, over the one-block probe cache: the estimate; then one backend over the
    # cache sized with it, whose buckets are each built once (largest first) and captured nothing twice.
    assert events[0] == "forward 8 over 1 blocks" and forwards == Counter({8: 1})
    assert kvs == [backend.kv.num_blocks] and events[1] == f"backend over {backend.kv.num_blocks} blocks"
    assert [e.split()[1] for e in events[2:]] == ["8", "4", "2", "1"]
    assert set(builds.values()) == {1} and len(builds) == len(buckets)
    assert backend.graphs.captures == 0  # capture=False: the same forwards, eagerly
    # The estimate: the largest forward's peak (nothing measurable off CUDA) plus the logits each other graph keeps.
    assert backend.reserved_bytes == TINY_VOCAB * 4 * sum(buckets[:-1])
    assert backend.kv.num_blocks == kv_blocks(config, loaded.shape, loaded.dtype, loaded.device, backend.reserved_bytes)
    assert "4 CUDA graphs (eager)" in backend.description


def test_the_cuda_backend_needs_the_varlen_kernel() -> None:
    loaded = from_config(tiny_config(), dtype=torch.float32)
    config = EngineConfig(kv_cache_tokens=1024, attention_kernel="torch")
    with pytest.raises(ValueError, match="varlen kernel"):
        create_backend(loaded, config, 256, kind="cuda", capture=False)


async def test_every_step_reads_the_buffers_allocated_at_start() -> None:
    """Through the engine (prompt chunks beside decodes, padded decode steps, rows leaving): every forward the
    CUDA backend runs reads its inputs from the step buffers it allocated when built, never from tensors made for
    the step, and those buffers are never replaced."""
    import asyncio

    from llmserve.engine.frontend.async_engine import AsyncEngine
    from llmserve.engine.types.request import GenerationRequest, StoppingParams

    loaded = from_config(tiny_config(max_positions=256), dtype=torch.float32)
    config = EngineConfig(
        block_size=16, kv_cache_tokens=2048, max_num_seqs=4, max_num_batched_tokens=48, attention_kernel="triton"
    )
    engine = AsyncEngine(loaded, config)
    backend = create_backend(loaded, config, engine.core.engine_core.max_model_len, kind="cuda", capture=False)
    assert isinstance(backend, CudaBackend) and backend.steps is not None
    steps = backend.steps
    buffers = {t.untyped_storage().data_ptr() for t in (steps.d64, steps.d32, steps.d_tables)}
    seen: list[set[int]] = []
    real_forward = backend.forward.logits

    def forward(input_ids, position_ids, keep, batch, lora=None):  # noqa: ANN001, ANN202
        inputs = (input_ids, position_ids, keep, batch.slot_mapping, batch.query_start, batch.seq_lens)
        seen.append({t.untyped_storage().data_ptr() for t in (*inputs, batch.block_tables)})
        return real_forward(input_ids, position_ids, keep, batch, lora)

    backend.forward.logits = forward  # type: ignore[method-assign]
    engine.core.engine_core.backend = backend
    await engine.start()
    try:
        requests = [
            GenerationRequest(f"r{i}", tuple(range(1, 30 + 7 * i)), stopping=StoppingParams(3 + 2 * i, ignore_eos=True))
            for i in range(3)
        ]

        async def run(request: GenerationRequest) -> int:
            return sum([len(d.token_ids) async for d in engine.generate(request)])

        async with asyncio.timeout(120):
            counts = await asyncio.gather(*(run(r) for r in requests))
    finally:
        await engine.shutdown()
    assert counts == [3, 5, 7]
    assert backend.graphs.replays > 0 and len(seen) > backend.graphs.replays  # padded decodes and eager steps
    assert all(ptrs <= buffers for ptrs in seen), seen
    assert {t.untyped_storage().data_ptr() for t in (steps.d64, steps.d32, steps.d_tables)} == buffers
