"""System 5: llmserve end to end: `python -m llmserve` as a subprocess on a loopback port, driven through
the `llmserve_client.AsyncClient` library. Its cost over system 4 is what the service layer costs.

With `metrics`, the same server exports Prometheus metrics and is scraped every SCRAPE_INTERVAL_S (three
times as often as Prometheus' default 15 s) for the whole run: the pair measures what metrics cost."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import torch

from benchmarks.loadgen import RequestRecord
from benchmarks.serve import Server, engine_flags
from benchmarks.systems.base import System
from benchmarks.workload import BenchRequest
from llmserve.engine.config import EngineConfig
from llmserve_client import AsyncClient, pb

SCRAPE_INTERVAL_S = 5.0
_OK = {
    pb.FINISH_REASON_LENGTH,
    pb.FINISH_REASON_EOS,
    pb.FINISH_REASON_STOP_SEQUENCE,
    pb.FINISH_REASON_STOP_TOKEN,
}


class GrpcSystem(System):
    """The server in a subprocess (benchmarks/serve.py), with the engine settings of the in-process run; one shared
    client channel, one streaming call per request.

    Peak memory is the server process's and its engine process's (benchmarks/memory.py). The server's output goes
    to `log_path`.
    """

    name = "llmserve_grpc"

    def __init__(
        self,
        model: str | None,
        device: torch.device,
        dtype: str,
        config: EngineConfig,
        log_path: Path,
        max_streams: int = 256,
        metrics: bool = False,
    ) -> None:
        super().__init__(device)
        flags = engine_flags(config, max_streams)
        self.server = Server(flags, model=model, device=str(device), dtype=dtype, metrics=metrics, log_path=log_path)
        if metrics:
            self.name = "llmserve_grpc_metrics"
        self.client: AsyncClient | None = None
        self.scraper: asyncio.Task[None] | None = None
        self.scrapes = 0

    @property
    def command(self) -> list[str]:
        return self.server.command

    async def start(self) -> None:
        self.server.start()
        await self.server.wait_serving()
        self.client = AsyncClient(self.server.address)
        if self.server.metrics_port is not None:
            self.scraper = asyncio.create_task(self._scrape_forever())

    async def _scrape_forever(self) -> None:
        url = self.server.metrics_url

        def scrape() -> None:
            with urllib.request.urlopen(url, timeout=10) as response:
                response.read()

        while True:
            await asyncio.to_thread(scrape)
            self.scrapes += 1
            await asyncio.sleep(SCRAPE_INTERVAL_S)

    async def stop(self) -> None:
        if self.scraper is not None:
            self.scraper.cancel()
            self.scraper = None
        if self.client is not None:
            await self.client.close()
            self.client = None
        await asyncio.to_thread(self.server.stop)

    def memory_pid(self) -> int:
        return self.server.pid

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        if self.client is None:
            raise RuntimeError("GrpcSystem.start() was not awaited")
        responses = self.client.generate(
            token_ids=list(request.prompt_ids),
            request_id=request.request_id,
            max_new_tokens=request.max_new_tokens,
            ignore_eos=True,
            return_token_ids=True,
        )
        try:
            async for response in responses:
                now = time.perf_counter()
                record.token_times.extend([now] * len(response.token_ids))
                if response.HasField("usage"):
                    record.cached_prompt_tokens = response.usage.cached_prompt_tokens
                if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    if response.finish_reason not in _OK:
                        raise RuntimeError(f"finished with {pb.FinishReason.Name(response.finish_reason)}")
                    record.end = now
        finally:
            await responses.aclose()
