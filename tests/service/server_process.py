"""`python -m llmserve` (or a launcher script around it) in a subprocess, with its log collected on a thread."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from harness import tiny_model


def save_tiny_model(folder: Path) -> Path:
    """The tiny model and its tokenizer saved as a local transformers folder, for `--model`."""
    loaded = tiny_model()
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


class ServerProcess:
    """The server in a subprocess on 127.0.0.1:<any port>; its stderr (the log) is collected on a thread.

    `script`: run this launcher file instead of `-m llmserve` (it takes the same arguments).
    """

    def __init__(self, *args: str, script: Path | None = None, env: Mapping[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        entry = [str(script)] if script is not None else ["-m", "llmserve"]
        cmd = [sys.executable, *entry, "--address", "127.0.0.1:0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=full_env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no log line matching {pattern!r}; log:\n{''.join(self.log)}")

    def wait_serving(self, timeout: float = 120) -> int:
        """Wait until the engine serves; returns the port."""
        port = int(self.wait_for(r"listening on .* \(port (\d+),", timeout=timeout).group(1))
        self.wait_for(r"serving ", timeout=timeout)
        return port

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
