"""The smg gateway (the `smg` binary of the pinned PyPI package, a Rust router) in front of llmserve replicas, on
loopback ports picked free at start: OpenAI-compatible HTTP on `port`, its Prometheus metrics on `metrics_port`.

`make gateway` and the gateway benchmark start it the same way (`python -m tests.deploy.smg`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tests.deploy.replicas import free_port

START_TIMEOUT_S = 60.0


def smg_binary() -> str | None:
    return shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")


def smg_command(workers: Sequence[str], port: int, metrics_port: int, policy: str, *extra: str) -> list[str]:
    """`smg launch` over gRPC workers (host:port), the way deploy/smg/ configures it."""
    binary = smg_binary()
    if binary is None:
        raise RuntimeError("smg is not installed: pip install 'llmserve[gateway]' (make venv installs it)")
    return [
        binary,
        "launch",
        "--worker-urls",
        *(f"grpc://{worker}" for worker in workers),
        "--policy",
        policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        *extra,
    ]


class Smg:
    """One smg process; `wait_ready` returns once every worker is registered (tokenizer loaded) and routable."""

    def __init__(self, workers: Sequence[str], log_path: Path, *extra: str, policy: str = "cache_aware") -> None:
        self.workers = list(workers)
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = smg_command(self.workers, self.port, self.metrics_port, policy, "--log-level", "info", *extra)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> str:
        """Wait for readiness and every worker healthy; returns the served model's id (from /v1/models)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited: {self.log_path.read_text()[-3000:]}")
            try:
                ready, _ = self.get("/readiness")
                status, body = self.get("/v1/models")
                if ready == 200 and status == 200 and len(self.healthy_workers()) == len(self.workers):
                    models = json.loads(body)["data"]
                    if models:
                        return str(models[0]["id"])
            except OSError:  # not listening yet
                pass
            time.sleep(0.1)
        raise TimeoutError(f"smg not ready after {timeout:.0f} s: {self.log_path.read_text()[-3000:]}")

    def healthy_workers(self) -> list[str]:
        status, body = self.get("/workers")
        if status != 200:
            return []
        workers = json.loads(body).get("workers", [])
        return [w["url"] for w in workers if w.get("is_healthy", w.get("healthy", False))]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    """`make gateway`: smg in front of running llmserve replicas, in the foreground until Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", nargs="+", default=["127.0.0.1:50051"], help="llmserve replicas (host:port)")
    parser.add_argument("--port", type=int, default=30000, help="the gateway's OpenAI-compatible HTTP port")
    parser.add_argument("--metrics-port", type=int, default=29000)
    parser.add_argument("--policy", default="cache_aware")
    args, extra = parser.parse_known_args(argv)
    cmd = smg_command(args.workers, args.port, args.metrics_port, args.policy, *extra)
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
