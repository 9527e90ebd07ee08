"""System 5: llmserve end to end: `python -m llmserve` as a subprocess on a loopback port, driven through
the `llmserve_client.AsyncClient` library. Its cost over system 4 is what the service layer costs.

With `metrics`, the same server exports Prometheus metrics and is scraped every SCRAPE_INTERVAL_S (three
times as often as Prometheus' default 15 s) for the whole run: the pair measures what metrics cost."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from benchmarks.loadgen import RequestRecord
from benchmarks.paths import child_env
from benchmarks.systems.base import System
from benchmarks.workload import BenchRequest
from llmserve.engine.config import EngineConfig
from llmserve_client import AsyncClient, pb

START_TIMEOUT_S = 300.0
SCRAPE_INTERVAL_S = 5.0
_OK = {
    pb.FINISH_REASON_LENGTH,
    pb.FINISH_REASON_EOS,
    pb.FINISH_REASON_STOP_SEQUENCE,
    pb.FINISH_REASON_STOP_TOKEN,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    model: str | None, device: torch.device, dtype: str, port: int, config: EngineConfig, max_streams: int
) -> list[str]:
    """The server's command line, with the engine settings of the in-process run."""
    cmd = [sys.executable, "-m", "llmserve", "--address", f"127.0.0.1:{port}"]
    cmd += ["--device", str(device), "--dtype", dtype, "--log-level", "WARNING"]
    if model is not None:
        cmd += ["--model", model]
    if config.kv_cache_tokens is not None:
        cmd += ["--kv-cache-tokens", str(config.kv_cache_tokens)]
    cmd += ["--block-size", str(config.block_size), "--max-num-seqs", str(config.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    cmd += ["--max-concurrent-streams", str(max_streams), "--max-waiting", str(max(config.max_waiting, max_streams))]
    if not config.enable_prefix_caching:
        cmd.append("--no-prefix-caching")
    if not config.cuda_graphs:
        cmd.append("--no-cuda-graphs")
    return cmd


class GrpcSystem(System):
    """The server in a subprocess, one shared client channel, one streaming call per request.

    Peak memory is the server process's and its engine process's (benchmarks/memory.py). The server's stderr goes
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
        self.port = free_port()
        self.command = server_command(model, device, dtype, self.port, config, max_streams)
        self.metrics_port = free_port() if metrics else None
        if self.metrics_port is not None:
            self.name = "llmserve_grpc_metrics"
            self.command += ["--metrics-port", str(self.metrics_port)]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.client: AsyncClient | None = None
        self.scraper: asyncio.Task[None] | None = None
        self.scrapes = 0

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess until stop()
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        log.close()
        self.client = AsyncClient(f"127.0.0.1:{self.port}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"llmserve exited with {self.process.returncode}; see {self.log_path}")
            try:
                if await self.client.health(timeout=2.0) == "SERVING":
                    if self.metrics_port is not None:
                        self.scraper = asyncio.create_task(self._scrape_forever())
                    return
            except Exception:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llmserve not SERVING after {START_TIMEOUT_S:.0f} s; see {self.log_path}")
            await asyncio.sleep(0.5)

    async def _scrape_forever(self) -> None:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"

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
        if self.process is not None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, 60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait)
            self.process = None

    def memory_pid(self) -> int:
        if self.process is None:
            raise RuntimeError("GrpcSystem.start() was not awaited")
        return self.process.pid

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
