"""The CUDA backend: the paged step (paged.py) over the Triton varlen kernel, decode steps replayed from CUDA graphs.

A decode-only step (every sequence computes one token and samples) is padded up to a batch bucket with rows that
write to the scratch slot. The Triton varlen kernel reads each sequence's blocks up to its own length, so the
batch size alone is a graph's key: one graph serves every context. Every bucket up to `max_num_seqs` is captured
when the backend is built, before anything is served: replaying a graph costs one launch instead of a few hundred
kernel launches from Python, and no request ever waits on a capture. A graph reads its inputs from the backend's
step buffers (step_buffers.py) at its bucket's offsets, so staging a step is the same whatever runs it, and returns
the logits in plan order through the step's kept rows. Steps that mix prompt chunks with decodes run eagerly, or
compiled piecewise around attention under `--mixed-steps` (piecewise.py).

Memory, captured once (vLLM v1 profiles a forward, sizes the KV cache, then captures): before the cache is sized,
`graph_reserve` runs one eager forward of the largest bucket over a one-block cache and nothing else, and the KV
budget leaves out its peak plus the logits every other graph keeps; the graphs share one memory pool and are
captured largest first, so the smaller ones reuse the largest one's working set. The cache is then allocated once,
at its final size, and each graph captured once over it; the backend reports the estimate beside what the capture
took. A capture that fails stops the start with the reason; `--no-cuda-graphs` serves without them.

Steps with a LoRA adapter's row run eagerly, through the LoRA hooks (the graphs and the compiled mixed steps
are captured without adapters); base-only steps keep replaying. With `capture=False` the same padded forwards run
eagerly instead of from graphs; the CPU tests use that to check the padding, the buckets and the rows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmserve.engine.backends.attention import ATTN_IMPLEMENTATION, register_attention
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.input_batch import InputBatch
from llmserve.engine.backends.lora_slots import BackendLora
from llmserve.engine.backends.metadata import GatheredBuilder
from llmserve.engine.backends.paged import (
    ModelForward,
    Packer,
    TransformersForward,
    packed_logits,
    paged_inputs,
    paged_step,
)
from llmserve.engine.backends.piecewise import MixedSteps
from llmserve.engine.backends.step_buffers import StepBuffers, StepInputs
from llmserve.engine.backends.torch_paged import varlen_kernel
from llmserve.engine.config import EngineConfig
from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sample.streams import StreamMark
from llmserve.engine.sched.plan import NO_ADAPTER, Pooled, StepPlan
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.model import LoadedModel

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class GraphCaptureError(RuntimeError):
    """A CUDA graph could not be captured at start-up."""


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    for b in buckets:
        if n <= b:
            return b
    return None


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    inputs: StepInputs  # views of the step buffers at this bucket's offsets
    logits: torch.Tensor | None  # the captured output, [bucket, vocab] in plan order


class DecodeGraphs:
    """A graph per batch bucket for the decode-only steps of one backend (eager forwards without capture): each
    runs `forward` over the varlen kernel's step buffers `steps`."""

    def __init__(self, forward: ModelForward, steps: StepBuffers, max_batch: int, *, capture: bool) -> None:
        self.forward_model = forward
        self.steps = steps
        self.capture = capture
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self._graphs: dict[int, _Graph] = {}
        self.replays = 0  # decode steps served from a bucket
        self.captures = 0  # graphs captured (once each)
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def __len__(self) -> int:
        return len(self._graphs)

    def build_all(self) -> None:
        """Capture (or, without capture, prepare) every bucket, the largest first (the smaller ones reuse its
        memory in the shared pool); raise GraphCaptureError on a failure."""
        for bp in reversed(self.buckets):
            try:
                self._graphs[bp] = self._build(bp)
            except Exception as exc:
                raise GraphCaptureError(f"CUDA graph capture failed at batch {bp}: {exc}") from exc

    def covers(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [len(plan.seqs), vocab], in plan order, for a decode-only step (one token per sequence)."""
        n = len(plan.seqs)
        bp = bucket(n, self.buckets)
        if bp is None:
            raise ValueError(f"no graph bucket for {n} sequences: check covers() first")
        entry = self._graphs[bp]
        self.steps.write(plan.seqs, rows_to=bp)
        self.replays += 1
        if entry.graph is None:
            return self.forward(entry.inputs)[:n]
        entry.graph.replay()
        assert entry.logits is not None
        return entry.logits[:n]

    def forward(self, step: StepInputs) -> torch.Tensor:
        return self.forward_model.logits(step.input_ids, step.positions, step.keep, step.attention)

    def padding_inputs(self, bp: int) -> StepInputs:
        """A step of `bp` padding rows (nothing live: each writes and reads the scratch slot), staged."""
        return self.steps.inputs_of(self.steps.write([], rows_to=bp))

    def estimate_bytes(self, peak: Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, int]]) -> int:
        """What capturing every bucket will take, without capturing: the largest bucket's eager forward, its peak
        as `peak` measures it, plus the logits each other graph keeps."""
        largest = self.buckets[-1]
        inputs = self.padding_inputs(largest)
        with torch.inference_mode():
            logits, used = peak(lambda: self.forward(inputs))
        row_bytes = logits.shape[1] * logits.element_size()
        return used + row_bytes * sum(self.buckets[:-1])

    def _build(self, bp: int) -> _Graph:
        entry = _Graph(None, self.padding_inputs(bp), None)
        if not self.capture:
            return entry
        with torch.inference_mode():
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # Triton's compile and cuBLAS's handles happen here, not in the capture
                    self.forward(entry.inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                entry.logits = self.forward(entry.inputs)
        entry.graph = graph
        self.captures += 1
        return entry


class CudaBackend:
    """The paged step's parts over the varlen kernel's step buffers on a CUDA device, with every decode bucket's
    graph captured at start-up (over `kv`, allocated at its final size before: see `graph_reserve`)."""

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
        """`reserved_bytes`: what the KV budget left out for the graphs (`graph_reserve`), for the description."""
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.kv = kv
        self.num_blocks = kv.num_blocks
        self.inputs, self.steps, self.forward = _varlen_parts(loaded, config, kv, max_model_len, lora=True)
        self.varlen_kernel = self.steps.kernel
        self.lora = self.forward.lora
        self.packer = Packer(
            self.inputs, GatheredBuilder(self.inputs, kv, self.dtype), self.lora, self.device, self.steps
        )
        self.graphs = DecodeGraphs(self.forward, self.steps, config.max_num_seqs, capture=capture)
        self.mixed: MixedSteps | None = None
        if config.mixed_steps != "eager":  # compiled over the forward's class's method, not a patched instance's
            forward = functools.partial(TransformersForward.logits, self.forward)
            self.mixed = MixedSteps(forward, self.steps, config.mixed_steps)
        free_before = _free_bytes(self.device) if capture else None
        self.graphs.build_all()
        self.paged = paged_step(loaded, kv, self.packer, self.forward, self.lora, logits=self._logits)
        # What the capture took (CUDA): reported beside the estimate, so that a run shows whether it holds.
        self.graph_bytes = None if free_before is None else free_before - (_free_bytes(self.device) or 0)
        self.reserved_bytes = reserved_bytes
        memory = f"{reserved_bytes / 2**20:.0f} MiB reserved"
        if self.graph_bytes is not None:
            memory += f", {self.graph_bytes / 2**20:.0f} MiB taken"
            if self.graph_bytes > reserved_bytes > 0:
                log.warning("the decode graphs took %s, above the estimate the KV budget left out", memory)
        self.description = (
            f"transformers layers, paged attention in one Triton varlen kernel, {len(self.graphs)} CUDA graphs "
            f"({'captured' if capture else 'eager'}) for decode steps ({memory})"
        )
        if self.mixed is not None:
            self.description += f", mixed steps through torch.compile ({config.mixed_steps})"

    def execute(self, plan: StepPlan) -> list[Sampled | RowFailed | Pooled]:
        return self.paged.execute(plan)

    def release(self, sequence: int) -> None:
        self.paged.release(sequence)

    def mark_stream(self, row: SampleRow) -> StreamMark:
        return self.paged.mark_stream(row)

    def rewind_stream(self, sequence: int, seed: int, draws: int) -> None:
        self.paged.rewind_stream(sequence, seed, draws)

    def _logits(self, plan: StepPlan) -> torch.Tensor:
        seqs = plan.seqs
        # The graphs and the compiled mixed steps hold no LoRA rows: a step with an adapter's row runs eagerly.
        base_only = all(s.lora_slot == NO_ADAPTER for s in seqs)
        decode_only = all(s.sample is not None and len(s.token_ids) == 1 for s in seqs)
        if base_only and decode_only and self.graphs.covers(len(seqs)):
            return self.graphs.run(plan)
        if self.mixed is not None and base_only and not any(s.drafts for s in seqs):  # drafts: eager (all logits)
            return self.mixed.run(plan)
        return packed_logits(self.packer, self.forward, plan)


def _varlen_parts(
    loaded: LoadedModel, config: EngineConfig, kv: KVCache, max_model_len: int, *, lora: bool
) -> tuple[InputBatch, StepBuffers, TransformersForward]:
    """What the graphs run on: the input batch, the varlen kernel's step buffers over `kv`, and transformers'
    forward through the paged attention function (with `lora`, LoRA slots through hooks when the config serves
    adapters; the estimate's probe hooks nothing onto the model)."""
    kernel = varlen_kernel(config.attention_kernel, loaded.device)
    if kernel is None:
        raise ValueError("the CUDA backend's decode graphs need the Triton varlen kernel (--attention-kernel triton)")
    register_attention()
    loaded.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    inputs = paged_inputs(config, kv, max_model_len, loaded.device)
    steps = StepBuffers(inputs, kv, kernel, config.max_num_batched_tokens)
    slots = (
        BackendLora.of(config, loaded.shape, loaded.model, loaded.dtype, loaded.device, fused=False) if lora else None
    )
    return inputs, steps, TransformersForward(loaded.model, slots)


def graph_reserve(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> int:
    """Device memory the decode graphs will take, estimated before the KV cache is sized and without capturing:
    `DecodeGraphs.estimate_bytes` on a backend over a one-block cache (released again)."""
    kv = KVCache(loaded.shape, 1, config.block_size, loaded.dtype, loaded.device)
    _, steps, forward = _varlen_parts(loaded, config, kv, max_model_len, lora=False)
    graphs = DecodeGraphs(forward, steps, config.max_num_seqs, capture=False)
    estimate = graphs.estimate_bytes(functools.partial(_peak, loaded.device))
    del graphs, steps, forward, kv
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    return estimate


def _peak(device: torch.device, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """`run()` and the device memory it allocated at its peak above what was in use before (0 off CUDA)."""
    if device.type != "cuda":
        return run(), 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
