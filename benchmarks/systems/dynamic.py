"""System 2, dynamic batching: requests grouped for up to `max_wait_s` or `max_batch` requests, left-padded,
one `model.generate` per group, one group at a time (the article's BatchScheduler)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from benchmarks.loadgen import RequestRecord
from benchmarks.systems.base import System
from benchmarks.systems.hf_common import generate_rows
from benchmarks.workload import BenchRequest
from llmserve.engine.types.model import LoadedModel


@dataclass(slots=True)
class _Pending:
    request: BenchRequest
    record: RequestRecord
    cancelled: threading.Event
    done: asyncio.Future


class DynamicBatchingSystem(System):
    """A batching loop: wait for a first request, gather more until the batch is full or the wait is over,
    run the batch to completion, repeat. Requests that arrive meanwhile wait for the next batch."""

    name = "dynamic"

    def __init__(self, loaded: LoadedModel, max_batch: int = 8, max_wait_s: float = 0.020) -> None:
        super().__init__(loaded.device)
        self.loaded = loaded
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.group_size = max_batch
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynamic")
        self.groups = itertools.count()
        self.queue: asyncio.Queue[_Pending] | None = None
        self.loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.loop_task = asyncio.create_task(self._batch_loop())

    async def stop(self) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
            await asyncio.gather(self.loop_task, return_exceptions=True)
        self.worker.shutdown(wait=True, cancel_futures=True)

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        if self.queue is None:
            raise RuntimeError("DynamicBatchingSystem.start() was not awaited")
        pending = _Pending(request, record, threading.Event(), asyncio.get_running_loop().create_future())
        await self.queue.put(pending)
        try:
            await pending.done
        except asyncio.CancelledError:
            pending.cancelled.set()
            raise

    async def _next_batch(self) -> list[_Pending]:
        batch = [await self.queue.get()]
        deadline = time.perf_counter() + self.max_wait_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), remaining))
            except TimeoutError:
                break
        return [p for p in batch if not p.cancelled.is_set()]

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if not batch:
                continue
            try:
                await loop.run_in_executor(self.worker, self._serve, batch)
            except Exception as exc:
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(exc)
                continue
            for p in batch:
                if not p.done.done():
                    p.done.set_result(None)

    def _serve(self, batch: list[_Pending]) -> None:
        group, started = next(self.groups), time.perf_counter()
        records = [p.record for p in batch]
        for record in records:
            record.group, record.started = group, started
        prompts = [p.request.prompt_ids for p in batch]
        cancelled = [p.cancelled for p in batch]
        generate_rows(self.loaded, prompts, batch[0].request.max_new_tokens, records, cancelled)
        end = time.perf_counter()
        for p in batch:
            if not p.cancelled.is_set():
                p.record.end = end
