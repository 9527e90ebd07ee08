"""System 1, naive: one worker thread runs `model.generate` for one request at a time, first come first served."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.loadgen import RequestRecord
from benchmarks.systems.base import System
from benchmarks.systems.hf_common import generate_rows
from benchmarks.workload import BenchRequest
from llmserve.engine.types.model import LoadedModel


class NaiveSystem(System):
    """The article's naive server: a queue in front of a single worker, batch size 1."""

    name = "naive"
    group_size = 1

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded.device)
        self.loaded = loaded
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="naive")
        self.groups = itertools.count()

    async def stop(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        cancelled = threading.Event()
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self.worker, self._serve, request, record, cancelled)
        try:
            await job
        except asyncio.CancelledError:
            cancelled.set()  # a running generate stops at its next step
            raise

    def _serve(self, request: BenchRequest, record: RequestRecord, cancelled: threading.Event) -> None:
        if cancelled.is_set():
            return
        record.group = next(self.groups)
        record.started = time.perf_counter()
        generate_rows(self.loaded, [request.prompt_ids], request.max_new_tokens, [record], [cancelled])
        if not cancelled.is_set():
            record.end = time.perf_counter()
