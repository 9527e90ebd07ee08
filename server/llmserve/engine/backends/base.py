"""What every backend is: the `Backend` protocol, and the KV cache they all keep in one layout.

The cache is sized once (`kv_blocks`, from the config and the model's shape) and allocated once, by
`create_backend`, before the backend that uses it is built; the KV tiers copy whole blocks out of it and back
(`BlockCopier`)."""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmserve.engine.backends.slots import block_range, slot
from llmserve.engine.config import EngineConfig
from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sample.streams import StreamMark
from llmserve.engine.sched.plan import Pooled, StepPlan
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.model import ModelShape

# One sampling row's result: its token, its failure, or (a pooling request's last step) its vector.
StepResult = Sampled | RowFailed | Pooled


class Backend(Protocol):
    """Runs steps for the engine: owns the model, the KV cache, whatever is compiled or captured for them, and
    whatever it keeps of each sequence between steps (random streams, pooling between prompt chunks, prompt
    logprobs), which nothing outside it reads.

    `execute` does the plan's block copies, one forward over every scheduled token, and samples the rows that
    ask for it (`plan.sample_rows()`: a sampling entry's row, or one per position of an entry with drafts). It
    returns one result per row, in that order: the picked token, or the failure of that row's sampling alone (or, for
    a pooling request's row, its vector: `Pooled`; the first token of a request that asks for prompt logprobs carries
    them, `Sampled.prompt`). It raises when the shared forward fails (every request of the step fails then).
    `release` drops everything kept of a sequence that has ended (finished, aborted, failed, the engine stopped or
    dead), once no step in flight reads it; a preempted sequence keeps its random stream (it goes on from where it
    was: its generated tokens stay), and its prompt chunks computed again from position 0 restart what it pooled or
    scored. Built once, by `create_backend`, before the engine serves anything.
    """

    name: str  # which path serves: "cpu", "torch", "cuda", "encoder"
    description: str  # one line for the start-up log and GetModelInfo
    device: torch.device
    dtype: torch.dtype
    num_blocks: int  # KV blocks the block pool may hand out (the cache has one scratch block more)
    block_size: int
    kv: KVCache  # the paged cache; the KV tiers copy whole blocks out of it and back (read_block, write_block)

    def execute(self, plan: StepPlan) -> Sequence[StepResult]: ...

    def release(self, sequence: int) -> None:
        """Drop what is kept of `sequence` (its seq_no); nothing held is fine."""
        ...

    def mark_stream(self, row: SampleRow) -> StreamMark:
        """A sampled row's random stream as it stands before the step draws, for speculation to settle after it
        (spec/verify.py)."""
        ...

    def rewind_stream(self, sequence: int, seed: int, draws: int) -> None:
        """Set `sequence`'s stream to where `draws` samples from `seed` leave it: its last sample was dropped
        (preempted while its step was in flight, core/steps.py's OverlapRunner)."""
        ...


def zeroed(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its memory is an anonymous mapping, which the kernel hands out zeroed page by page
    as it is first touched: a start does not write the whole pool (`torch.zeros` spent ~3 s on the CPU's default
    2.4 GiB), and a page no sequence has reached costs no resident memory."""
    if device.type != "cpu":
        return torch.zeros(size, dtype=dtype, device=device)
    count = math.prod(size)
    if count == 0:
        return torch.zeros(size, dtype=dtype)
    memory = mmap.mmap(-1, count * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(memory, dtype=dtype, count=count).view(size)


class KVCache:
    """Keys and values of every layer in one tensor [layers, 2, kv_heads, slots, head_dim].

    Slots follow slots.py's formula. There is one block more than the pool hands out: a scratch block that padded
    rows write to and read from, so that padding never touches anyone's KV. Allocated once, at the size
    `kv_blocks` gives, before the backend that uses it is built.
    """

    def __init__(
        self, shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        s = shape
        self.tensor = zeroed((s.num_layers, 2, s.num_kv_heads, slots, s.head_dim), dtype, device)

    @property
    def scratch_slot(self) -> int:
        return slot(self.scratch_block, 0, self.block_size)

    def block_view(self, block: int) -> torch.Tensor:
        """One block of every layer, K and V: [layers, 2, kv_heads, block_size, head_dim], a view."""
        return self.tensor[:, :, :, block_range(block, self.block_size)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy-on-write of a shared, partly filled block) in every layer, K and V."""
        for src, dst in copies:
            self.block_view(dst).copy_(self.block_view(src))


@dataclass(slots=True)
class BlockData:
    """One block's K and V of every layer on the host, [layers, 2, kv_heads, block_size, head_dim]. From a CUDA
    cache the copy runs on a side stream: `wait()` before reading `tensor` on the host."""

    tensor: torch.Tensor
    ready: Any = None  # a torch.cuda.Event recorded after the copy, or None when it is done already

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


class BlockCopier:
    """Copies whole blocks between a KV cache and host memory for the KV tiers.

    On the CPU a copy is a plain clone. On CUDA, reads go to pinned memory on a side stream that first waits for
    the step's stream (so it sees the KV written so far), and the step's stream waits for the copy's event
    before its next kernel (so the block is not overwritten under it): the host thread never blocks on either.
    Writes into the cache are issued on the step's stream, before the forward that reads them."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.cuda = kv.tensor.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=kv.tensor.device) if self.cuda else None  # type: ignore[no-untyped-call]

    def block_view(self, block: int) -> torch.Tensor:
        return self.kv.block_view(block)

    @property
    def block_shape(self) -> tuple[int, ...]:
        s = self.kv.shape
        return (s.num_layers, 2, s.num_kv_heads, self.kv.block_size, s.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.kv.block_size * self.kv.shape.kv_bytes_per_token(self.kv.tensor.element_size())

    def read(self, block: int) -> BlockData:
        src = self.block_view(block)
        if self._stream is None:
            return BlockData(src.clone(memory_format=torch.contiguous_format))
        dst = torch.empty(self.block_shape, dtype=src.dtype, pin_memory=True)
        main = torch.cuda.current_stream(src.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        main.wait_event(event)
        return BlockData(dst, event)

    def write(self, block: int, data: torch.Tensor) -> None:
        """Fill `block` from a host tensor of `block_shape` (pinned on CUDA: the copy is asynchronous, ordered
        before the next forward on the same stream)."""
        self.block_view(block).copy_(data.view(self.block_shape), non_blocking=self.cuda)


def kv_blocks(
    config: EngineConfig, shape: ModelShape, dtype: torch.dtype, device: torch.device, reserved: float = 0
) -> int:
    """How many KV blocks the pool gets, decided once before the cache is allocated: `--kv-cache-tokens` when
    set; else a share (`kv_cache_memory_fraction`) of the device's free memory less `reserved` bytes that are
    spoken for (CUDA: the decode graphs), or of the CPU budget. At least one."""
    if config.kv_cache_tokens is not None:
        return max(1, -(-config.kv_cache_tokens // config.block_size))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = max(0.0, free - reserved) * config.kv_cache_memory_fraction
    else:
        budget = config.cpu_kv_cache_bytes * config.kv_cache_memory_fraction
    element = torch.empty((), dtype=dtype).element_size()
    return max(1, int(budget // (shape.kv_bytes_per_token(element) * config.block_size)))
