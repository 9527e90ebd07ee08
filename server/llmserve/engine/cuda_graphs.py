"""Decode steps replayed from captured CUDA graphs.

A decode-only step (every sequence computes one token) has a shape fixed by two numbers: the batch and
the longest context. Both are rounded up to buckets, the batch padded with rows that write to a scratch
slot and read nothing, and one graph is captured per (batch, context) bucket on first use. Replaying a
graph costs one launch instead of a few hundred kernel launches from Python.

With `capture=False` the same padded forward runs eagerly; the CPU tests use that to check the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.engine.runner import DecodeGroup, ModelRunner, PagedBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    for b in buckets:
        if n <= b:
            return b
    return None


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    batch: PagedBatch
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor | None


class DecodeGraphs:
    """Per-bucket static buffers (and graphs) for decode-only steps of one runner."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_ctx: int, *, capture: bool = True) -> None:
        self.runner = runner
        self.capture = capture
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        ctx = max(runner.block_size * 16, 256)
        buckets = []
        while ctx < max_ctx:
            buckets.append(ctx)
            ctx *= 2
        self.ctx_buckets = tuple(buckets) + (max_ctx,)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def covers(self, batch: int, max_ctx: int) -> bool:
        return bucket(batch, self.batch_buckets) is not None and bucket(max_ctx, self.ctx_buckets) is not None

    def run(
        self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], lens: list[int]
    ) -> torch.Tensor:
        """Logits [len(ids), vocab] for a decode-only step (one token per sequence)."""
        n = len(ids)
        key = (bucket(n, self.batch_buckets), bucket(max(lens), self.ctx_buckets))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._build(*key)
        runner = self.runner
        bp, ctx = key
        pad = bp - n
        scratch_slot = runner.scratch_block * runner.block_size
        entry.input_ids[0].copy_(torch.tensor(ids + [0] * pad))
        entry.positions[0].copy_(torch.tensor(positions + [0] * pad))
        entry.batch.slot_mapping.copy_(torch.tensor(slots + [scratch_slot] * pad))
        decode_slots, bias = runner.decode_tensors(tables + [[runner.scratch_block]] * pad, lens + [1] * pad, ctx)
        entry.batch.decode[0].slots.copy_(decode_slots)
        entry.batch.decode[0].bias.copy_(bias)
        if entry.graph is None:
            return runner.forward(entry.input_ids, entry.positions, None, entry.batch)[:n]
        entry.graph.replay()
        return entry.logits[:n]

    def _build(self, bp: int, ctx: int) -> _Graph:
        runner = self.runner
        dev = runner.device
        kvh = runner.shape.num_kv_heads
        batch = PagedBatch(
            kv=runner.kv,
            slot_mapping=torch.zeros(bp, dtype=torch.long, device=dev),
            decode=[
                DecodeGroup(
                    0,
                    bp,
                    torch.zeros(bp * ctx, dtype=torch.long, device=dev),
                    torch.zeros(kvh * bp, 1, ctx, dtype=runner.dtype, device=dev),
                    ctx,
                )
            ],
            chunks=[],
        )
        input_ids = torch.zeros(1, bp, dtype=torch.long, device=dev)
        positions = torch.zeros(1, bp, dtype=torch.long, device=dev)
        entry = _Graph(None, batch, input_ids, positions, None)
        if not self.capture:
            return entry
        # Point every padded row at the scratch slot so warm-up and capture write nowhere that matters.
        batch.slot_mapping.fill_(runner.scratch_block * runner.block_size)
        batch.decode[0].slots.fill_(runner.scratch_block * runner.block_size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                runner.forward(input_ids, positions, None, batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.logits = runner.forward(input_ids, positions, None, batch)
        entry.graph = graph
        return entry
