"""`python -m llmserve` as every benchmark starts it: one server on a loopback port, as `make run` starts it (its
engine process included) plus the flags a mode adds, waited for until its health is SERVING, stopped at the end.

The ladder's gRPC systems, the dtypes, gateway, LoRA and speculative modes and the GPU probe all start their servers
here, so that a server measured in one mode is the server measured in another.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from benchmarks.paths import child_env
from llmserve.engine.config import EngineConfig
from llmserve_client import AsyncClient

START_TIMEOUT_S = 300.0


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_flags(config: EngineConfig, max_streams: int) -> list[str]:
    """The flags that give a server the engine sizes of `config` (what the in-process systems are built with), and
    room for `max_streams` streams in flight."""
    flags = ["--block-size", str(config.block_size), "--max-num-seqs", str(config.max_num_seqs)]
    flags += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    flags += ["--max-concurrent-streams", str(max_streams), "--max-waiting", str(max(config.max_waiting, max_streams))]
    if config.kv_cache_tokens is not None:
        flags += ["--kv-cache-tokens", str(config.kv_cache_tokens)]
    if not config.enable_prefix_caching:
        flags.append("--no-prefix-caching")
    if not config.cuda_graphs:
        flags.append("--no-cuda-graphs")
    return flags


class Server:
    """One `python -m llmserve` subprocess: `command` is fixed at construction (a free port, `--metrics-port` when
    `metrics`), `start` launches it, `wait_serving` returns once it is SERVING (or raises, naming its log, when it
    exits or the time runs out), `stop` terminates it. Session histories stay in memory (no benchmark keeps them).
    Its output goes to `log_path`, else to this process's."""

    def __init__(
        self,
        flags: Sequence[str] = (),
        *,
        model: str | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        metrics: bool = False,
        log_path: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port() if metrics else None
        self.command = [sys.executable, "-m", "llmserve", "--address", self.address, "--log-level", "WARNING"]
        self.command += ["--device", device, "--dtype", dtype] + (["--model", model] if model else [])
        if self.metrics_port is not None:
            self.command += ["--metrics-port", str(self.metrics_port)]
        self.command += list(flags)
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def metrics_url(self) -> str:
        if self.metrics_port is None:
            raise RuntimeError("the server was started without metrics")
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("Server.start() was not called")
        return self.process.pid

    def start(self) -> None:
        env = dict(child_env(), LLMSERVE_HISTORY_STORE="memory")
        if self.log_path is None:
            self.process = subprocess.Popen(self.command, env=env)
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child holds its own descriptor
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)

    async def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        where = f"; see {self.log_path}" if self.log_path else ""
        deadline = time.monotonic() + timeout_s
        async with AsyncClient(self.address, timeout=5) as client:
            while True:
                if self.process is None or self.process.poll() is not None:
                    code = None if self.process is None else self.process.returncode
                    raise RuntimeError(f"llmserve exited with {code}{where}")
                try:
                    if await client.health(timeout=2.0) == "SERVING":
                        return
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llmserve not SERVING after {timeout_s:.0f} s{where}")
                await asyncio.sleep(0.5)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
