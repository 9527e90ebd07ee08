"""llama.cpp's `llama-server` as a system beside llmserve (issue 35): one GGUF file, one server process on a
loopback port, one streaming `/completion` call per request with the prompt as token ids (no BOS is added to
a token prompt), greedy, EOS ignored, the generated token ids returned in each streamed event.

Nothing of llama.cpp is part of llmserve: the binary is found by `--llama-server` or $LLAMA_SERVER, and a mode
that wants it says so and skips it when it is absent. The server gets the CPU's threads (or `threads`) and one slot
per client, each slot the context a request of the workload needs: of the largest concurrency measured, or, with
`per_clients`, of each client count's windows, the server restarted between them (`prepare`): a server of 32 slots
serving one client is not what a user of one stream would start. A server that dies at start (this machine's AMX
repacking faults: `Illegal instruction`) is started again with `--no-repack`, and keeps it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.loadgen import RequestRecord
from benchmarks.serve import free_port
from benchmarks.systems.base import System
from benchmarks.workload import BenchRequest

START_TIMEOUT_S = 180.0
ENV = "LLAMA_SERVER"


def find_binary(flag: str | None) -> Path | None:
    """`flag`, else $LLAMA_SERVER, else `llama-server` on PATH; None when none is an executable file."""
    for candidate in (flag, os.environ.get(ENV), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


class LlamaCppSystem(System):
    """`llama-server -m GGUF` in a subprocess; see the module docstring. Peak memory is the server process's.
    `commands` and `start_s` hold each start's command line and seconds to healthy, by slot count."""

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        label: str,
        slots: int,
        slot_context: int,
        log_path: Path,
        threads: int | None = None,
        per_clients: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        super().__init__(torch.device("cpu"))
        self.name = f"llama.cpp {label}"
        self.binary, self.gguf, self.log_path = binary, gguf, log_path
        self.slots, self.slot_context = slots, slot_context
        self.threads = threads or os.cpu_count() or 1
        self.per_clients = per_clients
        self.extra = extra  # flags of another use of the server (`--embedding --pooling mean`: llama_embed.py)
        self.no_repack = False
        self.port = free_port()
        self.command = self.command_for(slots)
        self.commands: dict[int, list[str]] = {}
        self.start_s: dict[int, float] = {}
        self.process: subprocess.Popen | None = None

    def command_for(self, slots: int) -> list[str]:
        """The command line of a server with `slots` slots, each of `slot_context` tokens."""
        threads = str(self.threads)
        command = [
            str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", threads, "-tb", threads, "-np", str(slots), "-c", str(slots * self.slot_context), *self.extra,
        ]  # fmt: skip
        return [*command, "--no-repack"] if self.no_repack else command

    async def start(self) -> None:
        try:
            await self._launch()
        except RuntimeError:
            if self.no_repack:
                raise
            await self.stop()
            self.no_repack = True
            self.command = self.command_for(self.slots)
            await self._launch()

    async def prepare(self, clients: int) -> None:
        """With `per_clients`, a server of `clients` slots: the running one restarted where its slots differ."""
        if not self.per_clients or (clients == self.slots and self.process is not None):
            return
        await self.stop()
        self.slots, self.port = clients, free_port()
        self.command = self.command_for(clients)
        await self.start()

    async def _launch(self) -> None:
        """Start `command` and wait until it answers /health; RuntimeError where it exits first."""
        started = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess until stop()
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; see {self.log_path}")
            try:
                status, _ = await self._request("GET", "/health", None)
                if status == 200:
                    break
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy after {START_TIMEOUT_S:.0f} s; see {self.log_path}")
            await asyncio.sleep(0.5)
        self.commands[self.slots] = list(self.command)
        self.start_s[self.slots] = time.monotonic() - started

    async def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, 30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait)
            self.process = None

    def memory_pid(self) -> int:
        if self.process is None:
            raise RuntimeError("LlamaCppSystem.start() was not awaited")
        return self.process.pid

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        body = {
            "prompt": list(request.prompt_ids),
            "n_predict": request.max_new_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "return_tokens": True,
        }
        reader, writer = await self._open("POST", "/completion", body)
        try:
            status, chunked = await _status(reader)
            if status != 200:
                raise RuntimeError(f"llama-server answered {status}")
            async for event in _events(reader, chunked):
                now = time.perf_counter()
                record.token_times.extend([now] * len(event.get("tokens") or []))
                if event.get("stop"):
                    record.end = now
                    return
            raise RuntimeError("llama-server closed the stream before its last event")
        finally:  # a cancelled request closes its connection: the server stops generating for it
            writer.close()

    async def _open(
        self, method: str, path: str, body: dict | None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        payload = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        writer.write(head.encode() + payload)
        await writer.drain()
        return reader, writer

    async def _request(self, method: str, path: str, body: dict | None) -> tuple[int, bytes]:
        reader, writer = await self._open(method, path, body)
        try:
            status, _ = await _status(reader)
            return status, await reader.read()
        finally:
            writer.close()


async def _status(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """The response's status and whether its body is chunked; reads the headers up to the body."""
    line = await reader.readline()
    status = int(line.split()[1]) if line.startswith(b"HTTP/") else 0
    chunked = False
    while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
        chunked |= header.lower().replace(b" ", b"").startswith(b"transfer-encoding:chunked")
    return status, chunked


async def _events(reader: asyncio.StreamReader, chunked: bool):  # noqa: ANN202 - an async generator of dicts
    """Server-sent events' JSON payloads (`data: {...}` lines) of a chunked or plain body."""
    buffer = b""
    while True:
        if chunked:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                return
            buffer += await reader.readexactly(size)
            await reader.readline()  # the chunk's CRLF
        else:
            line = await reader.readline()
            if not line:
                return
            buffer += line
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.startswith(b"data: "):
                yield json.loads(line[6:])
