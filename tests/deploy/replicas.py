"""Real processes for the deployment tests: `python -m llmserve` replicas and nginx with deploy/nginx/llmserve.conf.

Everything listens on 127.0.0.1 ports picked free at start. `python -m tests.deploy.replicas` runs the same
three-replica setup in the foreground for a person to try (`make demo`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

from llmserve_client import NO_RETRY, Client
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "llmserve.conf"
SHIPPED_LISTEN = "listen 50050 http2;"
SHIPPED_UPSTREAMS = "/etc/nginx/llmserve-upstreams.conf"
START_TIMEOUT_S = 120.0


def accepts(port: int) -> bool:
    """Whether something listens on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class Replica:
    """One `python -m llmserve` (by default on the tiny random model), with metrics, named by `name`."""

    def __init__(
        self, name: str, log_dir: Path, *extra: str, model: str | None = "random:tiny", port: int | None = None
    ) -> None:
        self.name = name
        self.port = port or free_port()  # a port: a restart of a replica that was there (the proxy knows it)
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "llmserve", "--address", self.address]
        cmd += ["--model", model] if model else []
        cmd += ["--replica-name", name, "--metrics-port", str(self.metrics_port), "--kv-cache-tokens", "65536"]
        cmd += ["--log-level", "WARNING", *extra]
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        end = time.monotonic() + timeout
        with Client(self.address, timeout=2, retry=NO_RETRY) as client:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"replica {self.name} exited: {self.log_path.read_text()[-2000:]}")
                try:
                    if client.health() == "SERVING":
                        return
                except Exception:  # not listening yet
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"replica {self.name} not SERVING after {timeout:.0f} s")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def counter(self, name: str) -> float:
        """A label-less sample of the replica's metrics."""
        for line in self.metrics().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> None:
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stop_all(replicas: Iterable[Replica]) -> None:
    """SIGTERM to every replica, then wait for each: they drain and exit side by side, not one after another."""
    replicas = list(replicas)
    for replica in replicas:
        replica.terminate()
    for replica in replicas:
        replica.stop()


@contextlib.contextmanager
def serving(*replicas: Replica) -> Iterator[tuple[Replica, ...]]:
    """The replicas (started when built) once each is SERVING; every one stopped on the way out, whatever happened."""
    try:
        for replica in replicas:
            replica.wait_serving()
        yield replicas
    finally:
        stop_all(replicas)


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def needs_nginx() -> str:
    """For a test: nginx's binary; a skip where it is missing, a failure in CI (which installs it)."""
    import pytest  # only the tests need it, not `make demo`

    binary = nginx_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is missing: .ci/run installs it (make nginx)")
        pytest.skip("nginx is not installed (make nginx)")
    return binary


def write_nginx_conf(folder: Path, upstreams: list[str], port: int) -> Path:
    """deploy/nginx/llmserve.conf with only its listen port and upstreams file changed, in a main config
    that keeps every file nginx writes inside `folder`. Returns the main config's path."""
    shipped = NGINX_CONF.read_text()
    assert SHIPPED_LISTEN in shipped and SHIPPED_UPSTREAMS in shipped, "the shipped config changed its anchors"
    site = shipped.replace(SHIPPED_LISTEN, f"listen 127.0.0.1:{port} http2;")
    site = site.replace(SHIPPED_UPSTREAMS, str(folder / "llmserve-upstreams.conf"))
    (folder / "llmserve.conf").write_text(site)
    lines = [f"server {u} max_fails=1 fail_timeout=10s;" for u in upstreams]
    (folder / "llmserve-upstreams.conf").write_text("\n".join(lines) + "\n")
    temp = "\n".join(
        f"    {kind}_temp_path {folder / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers write the temp files under `folder`
    main = f"""{user}worker_processes 1;
daemon off;
pid {folder / "nginx.pid"};
error_log {folder / "error.log"} notice;
events {{ worker_connections 512; }}
http {{
    access_log {folder / "access.log"};
{temp}
    include {folder / "llmserve.conf"};
}}
"""
    path = folder / "nginx.conf"
    path.write_text(main)
    return path


class Nginx:
    """nginx in the foreground on 127.0.0.1:port in front of `upstreams`."""

    def __init__(self, binary: str, folder: Path, upstreams: list[str]) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.folder = folder
        self.conf = write_nginx_conf(folder, upstreams, self.port)
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None

    def check(self) -> subprocess.CompletedProcess[str]:
        """`nginx -t` on the config."""
        return subprocess.run(
            [self.binary, "-t", "-p", str(self.folder), "-c", str(self.conf)], capture_output=True, text=True
        )

    def start(self) -> None:
        log = open(self.folder / "nginx.out", "wb")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            [self.binary, "-p", str(self.folder), "-c", str(self.conf)], stdout=log, stderr=log
        )
        log.close()
        end = time.monotonic() + 20
        while not accepts(self.port):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"nginx did not start: {(self.folder / 'error.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Three replicas behind nginx until Ctrl-C (`make demo`)."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m tests.deploy.replicas", description=main.__doc__)
    parser.add_argument("--model", default=None, help="model spec for every replica; default: the default model")
    args = parser.parse_args(argv)
    binary = nginx_binary()
    if binary is None:
        raise SystemExit("nginx is not installed (make nginx, or apt-get install nginx)")
    with tempfile.TemporaryDirectory(prefix="llmserve-demo-") as tmp:
        folder = Path(tmp)
        replicas = [Replica(f"replica-{i}", folder, model=args.model) for i in range(3)]
        nginx: Nginx | None = None
        try:
            for r in replicas:
                r.wait_serving()
            nginx = Nginx(binary, folder, [r.address for r in replicas])
            nginx.start()
            print(f"nginx on {nginx.address} -> " + ", ".join(f"{r.name} {r.address}" for r in replicas))
            print("metrics: " + ", ".join(f"http://127.0.0.1:{r.metrics_port}/metrics" for r in replicas))
            if args.model and args.model.startswith("random:"):  # no tokenizer: token ids through the library
                print(
                    'try:  python -c "from llmserve_client import Client, CallInfo; info = CallInfo(); '
                    f"c = Client('{nginx.address}'); list(c.generate(token_ids=[5, 6, 7], session_id='ana', "
                    'max_new_tokens=4, info=info)); print(info.replica)"'
                )
            else:
                print(
                    f"try:  llmserve-client --address {nginx.address} "
                    'generate "Hi, I am Ana." --chat --session ana --stats'
                )
            print("      (the same session always lands on the same replica; another may land elsewhere)")
            print("Ctrl-C stops everything.")
            signal.signal(signal.SIGTERM, _interrupt)
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            if nginx is not None:
                nginx.stop()
            stop_all(replicas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
