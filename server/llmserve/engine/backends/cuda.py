"""The CUDA backend: the generic paged backend, with decode steps replayed from CUDA graphs captured at start-up.

A decode-only step (every sequence computes one token) is padded up to a batch bucket with rows that write to
the scratch slot. With the Triton varlen kernel (the default where Triton is installed) the batch is the whole
key: the kernel reads each sequence's blocks up to its own length, so one graph serves every context. With
the torch attention the padded gather also fixes the longest context, and a bucket is a (batch, context) pair.
Every bucket up to `max_num_seqs` (and the context limit) is captured when the backend is built, before
anything is served: replaying a graph costs one launch instead of a few hundred kernel launches from Python,
and no request ever waits on a capture. The graphs' memory is measured before the KV cache is sized
(`graph_bytes`: a probe capture over a one-block cache, released again) and left out of the pool's budget; the
cache is then allocated once, at its size, and the backend's graphs captured over it. A capture that fails
stops the start with the reason; `--no-cuda-graphs` serves without them.

A decode step's inputs come from the backend's persistent input batch (backends/input_batch.py: rows kept per
sequence, only what changed is written, pinned buffers, non-blocking copies into the bucket's buffers), the
same rows the eager steps use; the graph returns the logits in plan order through the step's row permutation.
Steps that mix prompt chunks with decodes run eagerly, and so do decode steps with a LoRA adapter's row.
With `capture=False` the same padded forward runs eagerly instead of from graphs; the CPU tests use that to
check the padding, the buckets and the rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmserve.engine.backends.attention import DecodeGroup, GatheredAttention, VarlenAttention
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.metadata import GatheredBuilder
from llmserve.engine.backends.torch_paged import TorchPagedBackend
from llmserve.engine.config import EngineConfig
from llmserve.engine.plan import NO_ADAPTER, StepPlan
from llmserve.models import LoadedModel

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class GraphCaptureError(RuntimeError):
    """A CUDA graph could not be captured at start-up."""


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    for b in buckets:
        if n <= b:
            return b
    return None


def context_buckets(block_size: int, max_ctx: int) -> tuple[int, ...]:
    """Powers of two from 256 (or 16 blocks) up to, and ending with, the context limit."""
    ctx = max(block_size * 16, 256)
    buckets = []
    while ctx < max_ctx:
        buckets.append(ctx)
        ctx *= 2
    return (*buckets, max_ctx)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    batch: GatheredAttention | VarlenAttention
    input_ids: torch.Tensor
    positions: torch.Tensor
    perm: torch.Tensor  # row of the plan's i-th sequence: the logits come back in plan order through it
    logits: torch.Tensor | None


class DecodeGraphs:
    """Per-bucket static buffers (and graphs) for decode-only steps of one backend.

    With the backend's varlen kernel a bucket is a batch size alone: the kernel reads each sequence's blocks
    up to its length, so one graph serves every context (block tables are as wide as the context limit).
    Without it, decode attention is a padded gather, and a bucket is a (batch, context) pair.
    """

    def __init__(self, backend: TorchPagedBackend, max_batch: int, max_ctx: int, *, capture: bool) -> None:
        self.backend = backend
        self.capture = capture
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.varlen = backend.varlen_kernel is not None
        self.ctx_buckets = (max_ctx,) if self.varlen else context_buckets(backend.block_size, max_ctx)
        self.max_blocks = -(-max_ctx // backend.block_size)
        self.rows = backend.inputs  # the rows the eager steps keep too
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0  # decode steps served from a bucket
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def __len__(self) -> int:
        return len(self._graphs)

    def build_all(self) -> None:
        """Capture (or, without capture, prepare) every bucket now; raise GraphCaptureError on a failure."""
        for bp in self.batch_buckets:
            for ctx in self.ctx_buckets:
                try:
                    self._graphs[bp, ctx] = self._build(bp, ctx)
                except Exception as exc:
                    raise GraphCaptureError(f"CUDA graph capture failed at batch {bp}, context {ctx}: {exc}") from exc

    def covers(self, batch: int, max_ctx: int) -> bool:
        return bucket(batch, self.batch_buckets) is not None and bucket(max_ctx, self.ctx_buckets) is not None

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [len(plan.seqs), vocab], in plan order, for a decode-only step (one token per sequence)."""
        backend = self.backend
        n = len(plan.seqs)
        longest = max(s.end for s in plan.seqs)
        bp, ctx = bucket(n, self.batch_buckets), bucket(longest, self.ctx_buckets)
        if bp is None or ctx is None:
            raise ValueError(f"no graph bucket for {n} sequences at context {longest}: check covers() first")
        entry = self._graphs[bp, ctx]
        self.replays += 1
        rows = self.rows
        rows.stage_decode(plan.seqs, bp)
        entry.input_ids[0].copy_(rows.ids[:bp], non_blocking=True)
        entry.positions[0].copy_(rows.positions[:bp], non_blocking=True)
        entry.batch.slot_mapping.copy_(rows.slots[:bp], non_blocking=True)
        entry.perm.copy_(rows.perm[:bp], non_blocking=True)
        batch = entry.batch
        if isinstance(batch, VarlenAttention):
            batch.seq_lens.copy_(rows.lens[:bp], non_blocking=True)
            batch.block_tables.copy_(rows.tables[:bp, : self.max_blocks], non_blocking=True)
        else:
            assert isinstance(backend.attention, GatheredBuilder)
            decode_slots, bias = backend.attention.decode_tensors(rows.tables[:bp], rows.lens[:bp], ctx)
            batch.decode[0].slots.copy_(decode_slots)
            batch.decode[0].bias.copy_(bias)
        if entry.graph is None:
            return backend.forward(entry.input_ids, entry.positions, None, entry.batch).index_select(0, entry.perm)[:n]
        entry.graph.replay()
        assert entry.logits is not None
        return entry.logits[:n]

    def _build(self, bp: int, ctx: int) -> _Graph:
        backend = self.backend
        dev = backend.device
        kvh = backend.shape.num_kv_heads
        scratch_slot = backend.kv.scratch_slot
        # Every padded row points at the scratch slot, so warm-up and capture write nowhere that matters.
        slot_mapping = torch.full((bp,), scratch_slot, dtype=torch.long, device=dev)
        kernel = backend.varlen_kernel
        batch: GatheredAttention | VarlenAttention
        if kernel is not None:
            batch = VarlenAttention(
                kv=backend.kv.tensor,
                slot_mapping=slot_mapping,
                kernel=kernel,
                query_start=torch.arange(bp + 1, dtype=torch.int32, device=dev),  # one token per sequence
                seq_lens=torch.ones(bp, dtype=torch.int32, device=dev),
                block_tables=torch.full((bp, self.max_blocks), backend.kv.scratch_block, dtype=torch.int32, device=dev),
                max_query_len=1,
                block_size=backend.block_size,
            )
        else:
            group = DecodeGroup(
                0,
                bp,
                torch.full((bp * ctx,), scratch_slot, dtype=torch.long, device=dev),
                torch.zeros(kvh * bp, 1, ctx, dtype=backend.dtype, device=dev),
                ctx,
            )
            batch = GatheredAttention(backend.kv.tensor, slot_mapping, [group], [])
        input_ids = torch.zeros(1, bp, dtype=torch.long, device=dev)
        positions = torch.zeros(1, bp, dtype=torch.long, device=dev)
        perm = torch.arange(bp, dtype=torch.long, device=dev)
        entry = _Graph(None, batch, input_ids, positions, perm, None)
        if not self.capture:
            return entry
        with torch.inference_mode():
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    backend.forward(input_ids, positions, None, batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                entry.logits = backend.forward(input_ids, positions, None, batch).index_select(0, perm)
        entry.graph = graph
        return entry


class CudaBackend(TorchPagedBackend):
    """The generic backend on a CUDA device, with every decode bucket's graph captured at start-up (over `kv`,
    allocated at its final size before: see `graph_bytes`)."""

    name = "cuda"

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        kv: KVCache,
        max_model_len: int,
        *,
        capture: bool = True,
        reserved_bytes: int = 0,
    ) -> None:
        """`reserved_bytes`: what the KV budget left out for the graphs (`graph_bytes`), for the description."""
        super().__init__(loaded, config, kv, max_model_len)
        self.graphs = DecodeGraphs(self, config.max_num_seqs, max_model_len, capture=capture)
        self.graphs.build_all()
        self.description = (
            f"{self.description}, {len(self.graphs)} CUDA graphs ({'captured' if capture else 'eager'}) "
            f"for decode steps; {reserved_bytes / 2**20:.0f} MiB kept for them"
        )

    def logits(self, plan: StepPlan) -> torch.Tensor:
        decode_only = len(plan.sampling) == len(plan.seqs) and all(len(s.token_ids) == 1 for s in plan.seqs)
        # The graphs are captured without adapters (the LoRA hooks add nothing while capturing): a decode step
        # with an adapter row runs eagerly, through the hooks; base-only decode steps keep replaying.
        decode_only = decode_only and all(s.lora_slot == NO_ADAPTER for s in plan.seqs)
        if decode_only and self.graphs.covers(len(plan.seqs), max(s.end for s in plan.seqs)):
            return self.graphs.run(plan)
        return super().logits(plan)


def graph_bytes(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> int:
    """Device memory that capturing every decode bucket takes (graph pool and static buffers), measured by a
    probe capture over a one-block cache that is released again: what the KV pool's budget leaves for them."""
    device = loaded.device
    torch.cuda.synchronize(device)
    free_before, _ = torch.cuda.mem_get_info(device)
    probe = CudaBackend(
        loaded, config, KVCache(loaded.shape, 1, config.block_size, loaded.dtype, device), max_model_len
    )
    torch.cuda.synchronize(device)
    used = max(0, free_before - torch.cuda.mem_get_info(device)[0])
    del probe
    torch.cuda.empty_cache()
    return used
