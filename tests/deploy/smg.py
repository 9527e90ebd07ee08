"""The smg gateway (the `smg` binary of the pinned PyPI package, a Rust router) in front of llmserve replicas, started
by the shipped deploy/smg/launch.sh on loopback ports picked free at start: OpenAI-compatible HTTP on `port`, its
Prometheus metrics on `metrics_port`. `make gateway` runs `python -m tests.deploy.smg` (replicas and smg, until
Ctrl-C); the gateway benchmark starts it the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.deploy.replicas import ROOT, Replica, serving
from tests.ports import free_port

LAUNCH = ROOT / "deploy" / "smg" / "launch.sh"

START_TIMEOUT_S = 60.0


def smg_binary() -> str | None:
    return shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")


def smg_command(workers: Sequence[str], *extra: str) -> list[str]:
    """deploy/smg/launch.sh over gRPC workers (host:port), the configuration the project ships."""
    return ["bash", str(LAUNCH), *workers, *extra]


def smg_env(port: int, metrics_port: int, policy: str) -> dict[str, str]:
    binary = smg_binary()
    if binary is None:
        raise RuntimeError("smg is not installed: pip install 'llmserve[gateway]' (make venv installs it)")
    settings = {"SMG": binary, "SMG_HOST": "127.0.0.1", "SMG_PORT": str(port), "SMG_METRICS_PORT": str(metrics_port)}
    return {**os.environ, **settings, "SMG_POLICY": policy}


class Smg:
    """One smg process; `wait_ready` returns once every worker is registered (tokenizer loaded) and routable."""

    def __init__(
        self, workers: Sequence[str], log_path: Path, *extra: str, policy: str = "cache_aware", port: int = 0
    ) -> None:
        self.workers = list(workers)
        self.port, self.metrics_port = port or free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = smg_command(self.workers, "--log-level", "info", *extra)
        env = smg_env(self.port, self.metrics_port, policy)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

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
        """SIGTERM: smg's graceful shutdown, which keeps its listener open for a fixed 5-s settle window (the
        launcher of smg 1.13 has no flag for it) before it exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL, for a test's teardown where smg's own shutdown is not under test: it saves the 5-s settle
        window of `stop` (launch.sh execs smg, so this is the gateway's own process and nothing is left behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def in_front(
    replicas: Sequence[Replica], log_dir: Path, *extra: str, policy: str = "cache_aware", port: int = 0
) -> Iterator[tuple[Smg, str]]:
    """smg in front of `replicas` (serving), logging to log_dir/smg.log, once ready: the gateway and the served
    model's id. Killed on the way out, whatever happened (`Smg.kill`: its graceful stop costs a 5-s settle window,
    and no caller tests smg's own shutdown)."""
    smg = Smg([r.address for r in replicas], log_dir / "smg.log", *extra, policy=policy, port=port)
    try:
        yield smg, smg.wait_ready()
    finally:
        smg.kill()


def main(argv: list[str] | None = None) -> int:
    """`make gateway`: REPLICAS llmserve replicas (ports 50051...) of the default model and smg in front of them on
    127.0.0.1:30000, in the foreground until Ctrl-C."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--model", default=None, help="the replicas' --model (default: the default model)")
    parser.add_argument("--port", type=int, default=30000, help="the gateway's OpenAI-compatible HTTP port")
    parser.add_argument("--policy", default="cache_aware")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="llmserve-gateway-"))
    replicas = [
        Replica(f"r{i}", logs, "--log-level", "INFO", model=args.model, port=50051 + i) for i in range(args.replicas)
    ]
    with serving(*replicas):
        for replica in replicas:
            print(f"replica {replica.name} on {replica.address} (log {replica.log_path})", flush=True)
        with in_front(replicas, logs, policy=args.policy, port=args.port) as (smg, model):
            print(
                f"smg on {smg.url} (log {smg.log_path}), model {model!r}:\n"
                f"  curl {smg.url}/v1/chat/completions -H 'Content-Type: application/json' -d "
                f'\'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}], '
                f'"stream": true}}\'\nCtrl-C stops everything.',
                flush=True,
            )
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
