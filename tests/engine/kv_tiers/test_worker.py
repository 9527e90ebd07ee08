"""KVTiers (kv_tiers/worker.py) over a real KV cache on the CPU, without a model: evicted blocks copied out into host
memory and queued for disk, loads answered at once from host memory (or from a write still queued) and read back by
the worker from disk, each finished load written into its block before the next forward, and every fault a failed
load (recomputed), never a failed step. Through the engine: tests/engine/kv_tiers/test_kv_tiers.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from llmserve.engine.backends.base import BlockCopier, KVCache
from llmserve.engine.kv_tiers.disk import DiskTier
from llmserve.engine.kv_tiers.host import HostTier
from llmserve.engine.kv_tiers.worker import KVTiers, LoadResult
from llmserve.engine.sched.block_pool import BlockContent, BlockPool, Evicted, chain_hash, prefix_root
from llmserve.engine.sched.plan import StepPlan
from llmserve.engine.types.model import ModelShape

SHAPE = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=100, context_length=256)
BS = 4
ROOT = prefix_root(None)


def content(i: int) -> BlockContent:
    tokens = tuple(range(i * BS, (i + 1) * BS))
    return BlockContent(chain_hash(ROOT, tokens), ROOT, tokens)


def cache() -> KVCache:
    kv = KVCache(SHAPE, 8, BS, torch.float32, torch.device("cpu"))
    for block in range(8):
        kv.block_view(block).fill_(float(block + 1))  # each block's KV tells which block it was
    return kv


def tiers(kv: KVCache, tmp_path: Path | None, host_blocks: int = 4) -> KVTiers:
    copier = BlockCopier(kv)
    host = HostTier(host_blocks * copier.block_bytes, copier.block_bytes) if host_blocks else None
    disk = None
    if tmp_path is not None:
        disk = DiskTier(tmp_path, b"fingerprint-0123", 64 * copier.block_bytes, copier.block_bytes)
        disk.open()
    worker = KVTiers(copier, host, disk)
    worker.start()
    return worker


def finished(worker: KVTiers, count: int, timeout: float = 10.0) -> dict[int, bool]:
    """Wait for `count` loads to finish, writing each into its block; block -> whether it loaded."""
    report: dict[int, bool] = {}
    deadline = time.monotonic() + timeout
    while len(report) < count:
        assert time.monotonic() < deadline, f"{len(report)} of {count} loads finished"
        worker.wait(0.05)
        worker.finish_loads(lambda block, ok: report.__setitem__(block, ok))
    return report


def test_a_block_offloaded_to_host_memory_loads_back_at_once_into_another_block() -> None:
    kv = cache()
    worker = tiers(kv, None)
    try:
        worker.offload([Evicted(2, content(0))])
        assert worker.has(content(0).block_hash, ROOT, content(0).tokens)
        assert not worker.has(content(1).block_hash, ROOT, content(1).tokens)
        worker.load(5, content(0))  # answered without the worker: the host tier holds it
        assert worker.in_flight == 1
        assert finished(worker, 1) == {5: True}
        assert torch.equal(kv.block_view(5), torch.full_like(kv.block_view(5), 3.0))  # block 2's KV, now in 5
        assert worker.in_flight == 0
        stats = worker.stats()
        assert stats.used_blocks == {"host": 1} and stats.reload.count == 1
    finally:
        worker.close()


def test_disk_writes_run_behind_the_step_and_loads_read_them_back(tmp_path: Path) -> None:
    kv = cache()
    worker = tiers(kv, tmp_path, host_blocks=0)
    try:
        worker.offload([Evicted(1, content(0)), Evicted(3, content(1))])
        # Held until written: a load of a block still queued for disk is answered from the copy at once.
        worker.load(6, content(0))
        worker.close()  # the queued writes finish
        assert worker.disk is not None and len(worker.disk.index) == 2
        assert finished(worker, 1) == {6: True}
        worker.start()
        worker.load(7, content(1))  # from the file, by the worker
        assert finished(worker, 1) == {7: True}
        assert torch.equal(kv.block_view(6), torch.full_like(kv.block_view(6), 2.0))
        assert torch.equal(kv.block_view(7), torch.full_like(kv.block_view(7), 4.0))
    finally:
        worker.close()


def test_a_missing_or_damaged_block_file_is_a_failed_load_not_a_failed_step(tmp_path: Path) -> None:
    kv = cache()
    worker = tiers(kv, tmp_path, host_blocks=0)
    try:
        worker.offload([Evicted(1, content(0))])
        worker.close()
        assert worker.disk is not None
        worker.disk.path(content(0).block_hash).write_bytes(b"not a block")
        worker.start()
        before = kv.block_view(4).clone()
        worker.load(4, content(0))
        assert finished(worker, 1) == {4: False}  # recomputed: the block keeps what it had
        assert torch.equal(kv.block_view(4), before)
    finally:
        worker.close()


def test_a_payload_that_does_not_fit_its_block_fails_that_load_alone() -> None:
    kv = cache()
    worker = tiers(kv, None)
    try:
        worker._finish(LoadResult(3, torch.zeros(5), "host", time.perf_counter()))  # a wrong shape, as a bug would
        worker.in_flight += 1
        assert finished(worker, 1) == {3: False}
    finally:
        worker.close()


def test_a_steps_tier_work_copies_out_its_evictions_and_starts_its_loads() -> None:
    kv = cache()
    worker = tiers(kv, None)
    try:
        worker.offload([Evicted(0, content(2))])
        plan = StepPlan(offloads=[Evicted(1, content(3))], loads=[(6, content(2))])
        worker.begin(plan)
        assert worker.has(content(3).block_hash, ROOT, content(3).tokens)
        assert finished(worker, 1) == {6: True}
        assert torch.equal(kv.block_view(6), torch.full_like(kv.block_view(6), 1.0))
    finally:
        worker.close()


def test_the_host_tier_keeps_its_latest_blocks_within_its_bound() -> None:
    kv = cache()
    worker = tiers(kv, None, host_blocks=2)
    try:
        worker.offload([Evicted(b, content(b)) for b in range(4)])
        held = [b for b in range(4) if worker.has(content(b).block_hash, ROOT, content(b).tokens)]
        assert held == [2, 3]
        assert worker.stats().tiers["host"].evicted_blocks == 2
    finally:
        worker.close()


def test_write_back_offloads_every_hashed_block_and_where_counts_pool_then_tiers(tmp_path: Path) -> None:
    kv = cache()
    worker = tiers(kv, tmp_path, host_blocks=0)
    pool = BlockPool(8, BS)
    try:
        blocks = pool.allocate(3)
        parent = ROOT
        hashes = []
        for i, block in enumerate(blocks):
            tokens = tuple(range(i * BS, (i + 1) * BS))
            block_hash = chain_hash(parent, tokens)
            pool.register(block, block_hash, parent, tokens)
            hashes.append(block_hash)
            parent = block_hash
        assert worker.write_back(pool) == 3
        worker.close()
        assert worker.disk is not None and len(worker.disk.index) == 3
        pool.release(blocks[1:])
        pool.release(pool.allocate(pool.num_free))  # the pool forgets the last two; the tiers hold them
        assert worker.where(hashes, pool) == (BS, 2 * BS)
    finally:
        worker.close()


@pytest.mark.parametrize("shared", [True, False])
def test_a_block_already_in_every_tier_is_not_copied_again(tmp_path: Path, shared: bool) -> None:
    kv = cache()
    worker = tiers(kv, tmp_path if shared else None)
    try:
        worker.offload([Evicted(1, content(0))])
        worker.close()
        copies = []
        real_read = worker.copier.read

        def read(block: int):  # noqa: ANN202
            copies.append(block)
            return real_read(block)

        worker.copier.read = read  # type: ignore[method-assign]
        worker.offload([Evicted(2, content(0))])
        assert copies == []
    finally:
        worker.close()
