"""`KVTiers`: the lower tiers of one engine and the worker thread that moves KV between them and the pool.

The step thread calls `offload` (right after `schedule`, before the forward) for the cached blocks the pool
just evicted: it copies each block out (a clone on the CPU, a side-stream copy into pinned memory on CUDA), puts
it in the host tier and queues the disk write; it never waits on a write. It calls `load` for each block a
waiting sequence needs back: a host-tier (or still unwritten) block completes at once, a disk block is read
by the worker ahead of the step that needs it. `poll` hands the finished loads back (KV on the host, or None
for a failed load: recomputed), and the core writes them into their blocks before the next forward.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmserve.engine.backends.base import BlockCopier, BlockData
from llmserve.engine.config import EngineConfig
from llmserve.engine.kv_tiers.disk import DiskTier, DiskTierError
from llmserve.engine.kv_tiers.host import HostTier
from llmserve.engine.sched.block_pool import BlockContent, BlockHash, BlockPool, Evicted
from llmserve.engine.sched.plan import StepPlan
from llmserve.engine.types.stats import LatencyHistogram, TierStats

if TYPE_CHECKING:
    from llmserve.engine.types.model import LoadedModel

log = logging.getLogger(__name__)

RELOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Bytes of disk writes queued behind the step at most; past it an offload is dropped rather than wait.
MAX_PENDING_BYTES = 1 << 30
_LOAD, _WRITE, _STOP = 0, 1, 2  # worker priorities: loads before writes, the stop after both


@dataclass(slots=True)
class LoadResult:
    """A finished load: `data` is the block's KV on the host (block layout), or None when the load failed."""

    block: int
    data: torch.Tensor | None
    tier: str
    started: float


@dataclass(slots=True, frozen=True)
class _Load:
    """A disk read for the worker: `content`'s KV into `block`, asked for at `started`."""

    block: int
    content: BlockContent
    started: float


# The worker's jobs: a block to write to disk, a load, or None (stop).
_Job = BlockContent | _Load | None


def model_fingerprint(loaded: LoadedModel, dtype: torch.dtype, block_size: int, block_shape: Sequence[int]) -> bytes:
    """A digest of what a block's KV depends on: the model config, a sample of every weight, the cache's dtype
    and block layout. Two models that differ in any weight sampled, or in any of the rest, never share a file.
    Each tensor contributes its name, shape, dtype and up to 8,192 evenly spaced elements (hashing 14 GB of a
    7B model at start would take seconds)."""
    digest = hashlib.blake2b(digest_size=16)
    config = loaded.model.config
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    meta = {"name": loaded.name, "dtype": str(dtype), "block_size": block_size, "block_shape": list(block_shape)}
    digest.update(json.dumps(meta, sort_keys=True).encode())
    digest.update(text.encode())
    with torch.no_grad():
        for name, tensor in sorted(loaded.model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // 8192)
            sample = flat[::step][:8192].to("cpu", torch.float64).contiguous()
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.digest()


class KVTiers:
    """Host and/or disk tiers over one KV cache; `start` the worker before use, `close` to finish the writes."""

    def __init__(self, copier: BlockCopier, host: HostTier | None, disk: DiskTier | None) -> None:
        if host is None and disk is None:
            raise ValueError("KVTiers needs a host or a disk tier")
        self.copier = copier
        self.host = host
        self.disk = disk
        self._pending: dict[BlockHash, tuple[BlockContent, BlockData]] = {}  # offloads not yet on disk
        self._lock = threading.Lock()
        self._done: list[LoadResult] = []
        self._done_event = threading.Event()
        self._jobs: queue.PriorityQueue[tuple[int, int, _Job]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._reload = LatencyHistogram(RELOAD_BUCKETS)
        self.dropped_writes = 0
        self.in_flight = 0

    # -- the step thread ---------------------------------------------------------------------------

    def has(self, block_hash: BlockHash, parent: BlockHash, tokens: Sequence[int]) -> bool:
        """TierLookup for the scheduler: whether some tier holds exactly this block."""
        if self.host is not None and self.host.index.has(block_hash, parent, tokens):
            return True
        if self.disk is None:
            return False
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None and pending[0] == BlockContent(block_hash, parent, tuple(tokens)):
            return True
        return self.disk.index.has(block_hash, parent, tokens)

    def offload(self, evicted: list[Evicted]) -> None:
        """Copy the evicted blocks' KV out of the cache now (before the next forward) and keep it in the tiers."""
        for item in evicted:
            content = item.content
            in_host = self.host is not None and content.block_hash in self.host.index
            in_disk = self.disk is None or content.block_hash in self.disk.index or content.block_hash in self._pending
            if in_host and in_disk:
                continue
            data = self.copier.read(item.block)
            if self.host is not None and not in_host:
                self.host.put(content, data)
            if self.disk is not None and not in_disk:
                with self._lock:
                    if (len(self._pending) + 1) * self.copier.block_bytes > MAX_PENDING_BYTES:
                        self.dropped_writes += 1
                        continue
                    self._pending[content.block_hash] = (content, data)
                self._jobs.put((_WRITE, next(self._order), content))

    def load(self, block: int, content: BlockContent) -> None:
        """Start filling `block` with `content`'s KV; the result comes back through `poll`."""
        started = time.perf_counter()
        self.in_flight += 1
        data = self.host.get(content) if self.host is not None else None
        if data is not None:
            self._finish(LoadResult(block, data.tensor, "host", started))
            return
        with self._lock:
            pending = self._pending.get(content.block_hash)
        if pending is not None and pending[0] == content:
            self._finish(LoadResult(block, pending[1].tensor, "disk", started))
            return
        if self.disk is None:  # the host tier lost it since the lookup (evicted meanwhile): recomputed
            if self.host is not None:
                self.host.index.counters.failed_loads += 1
            self._finish(LoadResult(block, None, "host", started))
            return
        self._jobs.put((_LOAD, next(self._order), _Load(block, content, started)))

    def poll(self) -> list[LoadResult]:
        """The loads finished since the last call; the caller writes their KV in and reports them."""
        with self._lock:
            done, self._done = self._done, []
            self._done_event.clear()
        now = time.perf_counter()
        for result in done:
            self.in_flight -= 1
            if result.data is not None:
                self._reload.observe(now - result.started)
        return done

    def finish_loads(self, report: Callable[[int, bool], None]) -> None:
        """Write the KV of finished loads into their blocks (before the next forward) and `report(block, ok)`
        each; a failed one is recomputed."""
        for result in self.poll():
            ok = result.data is not None
            if result.data is not None:
                try:
                    self.copier.write(result.block, result.data)
                except Exception:  # a bad payload (shape, dtype) is a failed load, not a failed step
                    log.exception("writing reloaded KV into block %d failed", result.block)
                    ok = False
            report(result.block, ok)

    def begin(self, plan: StepPlan) -> None:
        """A step's tier work, before its forward: copy out the blocks its schedule evicted, start its loads."""
        self.offload(plan.offloads)
        for block, content in plan.loads:
            self.load(block, content)

    def wait(self, timeout: float) -> None:
        """Block until a load finishes (or `timeout`; at once when none is in flight): the step loop's idle wait
        while only loads are pending."""
        if self.in_flight:
            self._done_event.wait(timeout)

    def write_back(self, pool: BlockPool) -> int:
        """Offload every hashed block still in the pool (at shutdown, so that a restart finds it on disk)."""
        blocks = [b for b in range(pool.num_blocks) if pool.content(b) is not None and not pool.is_loading(b)]
        self.offload([Evicted(b, content) for b in blocks if (content := pool.content(b)) is not None])
        return len(blocks)

    # -- the worker --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Finish the queued writes and stop the worker."""
        if self._thread is not None:
            self._jobs.put((_STOP, next(self._order), None))
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            try:
                if isinstance(job, _Load):
                    self._load_from_disk(job)
                else:
                    self._write(job)
            except Exception:  # a tier fault must not end the worker: the block is recomputed instead
                log.exception("KV tier worker job failed")
                if isinstance(job, _Load):
                    self._finish(LoadResult(job.block, None, "disk", job.started))

    def _write(self, content: BlockContent) -> None:
        assert self.disk is not None
        with self._lock:
            pending = self._pending.get(content.block_hash)
        if pending is None:
            return
        data = pending[1]
        data.wait()
        self.disk.put(content, data.tensor.reshape(-1).view(torch.uint8).numpy().data)
        with self._lock:
            self._pending.pop(content.block_hash, None)

    def _load_from_disk(self, job: _Load) -> None:
        assert self.disk is not None
        payload = self.disk.get(job.content)
        data = None
        if payload is not None:
            host = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.copier.kv.tensor.dtype)
            data = host.view(self.copier.block_shape)
            if self.copier.cuda:
                data = data.pin_memory()
        self._finish(LoadResult(job.block, data, "disk", job.started))

    def _finish(self, result: LoadResult) -> None:
        with self._lock:
            self._done.append(result)
            self._done_event.set()

    # -- the metrics -------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        tiers = [t for t in (self.host, self.disk) if t is not None]
        return TierStats(
            tiers={t.name: t.index.counters for t in tiers},
            used_blocks={t.name: len(t.index) for t in tiers},
            capacity_blocks={t.name: t.index.capacity_blocks for t in tiers},
            block_bytes=self.copier.block_bytes,
            reload=self._reload.snapshot(),
            dropped_writes=self.dropped_writes,
        )

    def where(self, block_hashes: Sequence[BlockHash], pool: BlockPool) -> tuple[int, int]:
        """(tokens in the pool, tokens in the tiers after those) of a chain of full blocks, from its first block
        on (for GetSession of a session the pool evicted)."""
        in_pool = 0
        while in_pool < len(block_hashes) and pool.holds(block_hashes[in_pool]):
            in_pool += 1
        in_tiers = in_pool
        for block_hash in block_hashes[in_pool:]:
            in_host = self.host is not None and block_hash in self.host.index
            if not (in_host or (self.disk is not None and block_hash in self.disk.index)):
                break
            in_tiers += 1
        return in_pool * pool.block_size, (in_tiers - in_pool) * pool.block_size


def build_tiers(config: EngineConfig, loaded: LoadedModel, copier: BlockCopier) -> KVTiers | None:
    """The tiers the engine config asks for (None: none); raises DiskTierError naming the flag at fault."""
    host_bytes = config.kv_offload_bytes
    disk_dir = config.kv_offload_dir
    if not host_bytes and not disk_dir:
        return None
    if not config.enable_prefix_caching:
        raise DiskTierError("--kv-offload-gib / --kv-offload-dir need prefix caching (drop --no-prefix-caching)")
    block_bytes = copier.block_bytes
    host = None
    if host_bytes:
        if host_bytes < block_bytes:
            raise DiskTierError(f"--kv-offload-gib: {host_bytes} bytes hold no KV block ({block_bytes} bytes each)")
        host = HostTier(host_bytes, block_bytes)
    disk = None
    if disk_dir:
        dtype = copier.kv.tensor.dtype
        fingerprint = model_fingerprint(loaded, dtype, copier.kv.block_size, copier.block_shape)
        disk = DiskTier(Path(disk_dir), fingerprint, config.kv_offload_disk_bytes, block_bytes)
        found = disk.open()
        log.info("KV disk tier at %s: %d blocks found", disk.folder, found)
    return KVTiers(copier, host, disk)
