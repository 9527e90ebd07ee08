"""What every system offers the load generator."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from benchmarks import memory
from benchmarks.loadgen import Measurement, RequestRecord, Schedule, closed_loop
from benchmarks.workload import BenchRequest


class System:
    """A server under test. `generate` serves one request and stamps its tokens into the record.

    `group_size` is set by single-worker systems (naive: 1, dynamic batching: the batch size): their
    queueing beyond that concurrency is composed from measured service times instead of waited out.
    """

    name: str = "system"
    group_size: int | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    async def start(self) -> None:
        """Load or launch whatever the system needs; called once before any run."""

    async def stop(self) -> None:
        """Release everything `start` acquired."""

    async def prepare(self, clients: int) -> None:
        """Called before the windows at `clients` closed-loop clients (benchmarks/alternation.py's `alternate`): a
        server sized by its client count (llama-server's slots) restarts here. Nothing by default."""

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        """Serve `request`: append a timestamp per output token, set `record.end` when done.

        Must abort the request when cancelled.
        """
        raise NotImplementedError

    def memory_pid(self) -> int:
        """The process whose peak memory is reported (the server subprocess for the gRPC system)."""
        return os.getpid()

    async def run(self, requests: Iterator[BenchRequest], schedule: Schedule) -> Measurement:
        """One closed-loop measurement, with the peak memory seen during it."""
        pid = self.memory_pid()
        memory.reset_peak(pid, self.device)
        measurement = await closed_loop(self.generate, requests, schedule, spread=self.group_size is None)
        measurement.peak_memory_bytes = memory.peak_bytes(pid, self.device)
        return measurement
