"""A real `redis-server` for the tests, on a free loopback port, with nothing written to disk.

`make redis` (and so `make test` and .ci/run) installs Debian's redis-server; a test that needs one is skipped,
saying why, only when the binary is missing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.ports import free_port


def redis_binary() -> str | None:
    return shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)


class RedisServer:
    """`redis-server --save '' --appendonly no` on 127.0.0.1:<free port>; `stop()` and `start()` again on the
    same port (its data is lost, as a restarted Redis without persistence loses it)."""

    def __init__(self) -> None:
        binary = redis_binary()
        if binary is None:
            pytest.skip("redis-server is not installed (make redis installs Debian's package)")
        self.binary = binary
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if self._pong():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 20 s")

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)
