"""llama.cpp's `llama-server --embedding` as the peer of bench-embed (issue 54): the same MiniLM folder converted to
an F32 GGUF (or F16) by llama.cpp's own `convert_hf_to_gguf.py` (once, into a cache outside the repo), one server
process on a loopback port (benchmarks/systems/llama_cpp.py starts it), mean pooling and L2 normalization as
sentence-transformers' pipeline, and closed-loop callers that POST /v1/embeddings (`input` a list, `encoding_format:
base64`: packed float32 as Embed's answer is) over one kept-alive HTTP/1.1 connection each, so that neither side pays
a connection per call.

Nothing of llama.cpp is part of llmserve: the binary is found by --llama-server, $LLAMA_SERVER, $LLAMA_CPP_BIN or PATH,
the converter by --llama-convert, $LLAMA_CPP_CONVERT or a llama.cpp checkout above the binary (its gguf-py put first
on the converter's PYTHONPATH); where either is missing and no GGUF is cached, `locate` says why and the mode skips
the peer. A ready file can be given with --peer-gguf.

llama.cpp's BERT is not exact: its FFN uses ggml's tanh-approximated GELU (an F16 lookup table on the CPU) where BERT
uses erf, ~3e-4 off sentence-transformers' normalized vectors on short sentences (F16 weights: 3.6e-4; llmserve:
~3e-7). `max_difference` measures it before any window is timed, and the mode refuses a peer further off than
`TOLERANCE`.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.systems.llama_cpp import LlamaCppSystem, find_binary
from benchmarks.window import Window

TOLERANCE = 1e-3  # of any component of a normalized vector; a wrong pooling or tokenizer is ~1e-2 off
CACHE_ENV, CONVERT_ENV, BIN_ENV = "LLMSERVE_BENCH_CACHE", "LLAMA_CPP_CONVERT", "LLAMA_CPP_BIN"
CONVERTER = "convert_hf_to_gguf.py"
SLOT_CONTEXT = 512  # MiniLM's positions: one input per slot, none cut by the server


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llmserve-bench")


def find_server(flag: str | None) -> Path | None:
    """--llama-server, $LLAMA_SERVER, $LLAMA_CPP_BIN/llama-server, then PATH (llama_cpp.find_binary)."""
    folder = os.environ.get(BIN_ENV)
    return find_binary(flag or (str(Path(folder) / "llama-server") if folder else None))


def find_converter(flag: str | None, binary: Path) -> Path | None:
    """--llama-convert, $LLAMA_CPP_CONVERT, else convert_hf_to_gguf.py in a folder above the binary (a checkout's
    build/bin/llama-server); None where none is a file."""
    candidates = [flag, os.environ.get(CONVERT_ENV), *(str(up / CONVERTER) for up in binary.resolve().parents[:3])]
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


def convert(folder: Path, converter: Path, out: Path, outtype: str = "f32") -> Path:
    """`folder` as a GGUF of `outtype` at `out`, made once (into a partial file renamed when whole)."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    env = dict(os.environ)
    gguf_py = converter.parent / "gguf-py"  # the converter's own gguf package, newer than a pinned one
    if gguf_py.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(gguf_py), env.get("PYTHONPATH")]))
    command = [sys.executable, str(converter), str(folder), "--outtype", outtype, "--outfile", str(partial)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not partial.is_file():
        raise RuntimeError(f"{converter.name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    partial.rename(out)
    return out


@dataclass(slots=True)
class Located:
    """What the peer needs, or why it is skipped (`skipped` set, the rest None)."""

    binary: Path | None = None
    gguf: Path | None = None
    skipped: str | None = None


def locate(
    folder: Path, server_flag: str | None, convert_flag: str | None, gguf_flag: str | None, outtype: str = "f32"
) -> Located:
    """The binary and the GGUF of `folder` in `outtype` (f32, f16: given, cached, or converted now); a reason where
    one cannot be had."""
    binary = find_server(server_flag)
    if binary is None:
        reason = f"no llama-server (pass --llama-server PATH or set $LLAMA_SERVER or ${BIN_ENV})"
        return Located(skipped=reason)
    if gguf_flag:
        return Located(binary, Path(gguf_flag))
    cached = cache_dir() / f"{folder.name}-{outtype}.gguf"
    converter = find_converter(convert_flag, binary)
    if not cached.is_file() and converter is None:
        return Located(skipped=f"no {cached} and no {CONVERTER} (pass --llama-convert PATH or set ${CONVERT_ENV})")
    return Located(binary, cached if cached.is_file() else convert(folder, converter, cached, outtype))


class Connection:
    """One kept-alive HTTP/1.1 connection to the server; opened again where the server closed it (llama-server
    closes a connection after 100 requests)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: dict) -> bytes:
        """The body of the answer to POST `path`; RuntimeError on a status other than 200."""
        for attempt in range(2):
            try:
                return await self._post(path, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _post(self, path: str, body: dict) -> bytes:
        if self.streams is None:
            self.streams = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.streams
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionResetError("the server closed the connection")
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        data = await reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            self.close()
        if int(status_line.split()[1]) != 200:
            raise RuntimeError(f"llama-server answered {status_line.decode().strip()}: {data[:500]!r}")
        return data

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


async def embed(connection: Connection, texts: Sequence[str]) -> np.ndarray:
    """The server's normalized vectors of `texts`, in order (rows of float32)."""
    answer = json.loads(await connection.post("/v1/embeddings", {"input": list(texts), "encoding_format": "base64"}))
    rows = sorted(answer["data"], key=lambda item: item["index"])
    return np.stack([np.frombuffer(base64.b64decode(row["embedding"]), dtype=np.float32) for row in rows])


class LlamaEmbedServer:
    """`llama-server --embedding --pooling mean` on the GGUF, `slots` inputs computed together, CPU threads as the
    other llama.cpp systems; see the module docstring."""

    def __init__(self, located: Located, slots: int, log_path: Path, threads: int | None = None) -> None:
        if located.binary is None or located.gguf is None:
            raise ValueError(f"the peer is skipped: {located.skipped}")
        self.gguf = located.gguf
        # An input is one slot's task; one forward takes up to --ubatch-size tokens of the slots' inputs together.
        flags = ("--embedding", "--pooling", "mean")
        self.server = LlamaCppSystem(located.binary, located.gguf, "embed", slots, SLOT_CONTEXT, log_path, threads,
                                     extra=flags)  # fmt: skip

    @property
    def command(self) -> list[str]:
        return self.server.command

    @property
    def pid(self) -> int:
        return self.server.memory_pid()

    def start(self) -> None:
        asyncio.run(self.server.start())

    def stop(self) -> None:
        asyncio.run(self.server.stop())

    def max_difference(self, texts: Sequence[str], reference: np.ndarray) -> float:
        """The largest difference of any component between the server's vectors of `texts` and `reference` (the
        library's, normalized)."""

        async def go() -> np.ndarray:
            connection = Connection(self.server.port)
            try:
                return await embed(connection, texts)
            finally:
                connection.close()

        return float(np.abs(asyncio.run(go()) - reference).max())

    def window(self, texts: list[str], callers: int, per_call: int, warmup_s: float, window_s: float) -> Window:
        """`callers` closed-loop callers, each sending `per_call` texts per call, taken in turn (as embed.py's
        server_window does for Embed)."""
        return asyncio.run(self._window(texts, callers, per_call, Window.starting_now(warmup_s, window_s)))

    async def _window(self, texts: list[str], callers: int, per_call: int, window: Window) -> Window:
        order = itertools.cycle(range(0, len(texts), per_call))

        async def caller() -> None:
            connection = Connection(self.server.port)
            try:
                await embed(connection, texts[:1])  # connected before the clock starts
                while not window.over:
                    start = next(order)
                    began = window.begin()
                    vectors = await embed(connection, texts[start : start + per_call])
                    window.done(began, [(time.monotonic(), float(len(vectors)))])
            finally:
                connection.close()

        await asyncio.gather(*(caller() for _ in range(callers)))
        return window


def available(folder: Path) -> bool:
    """Whether a llama-server and the folder's GGUF (or a converter) are here, from the environment alone."""
    located = find_server(None)
    return located is not None and (
        (cache_dir() / f"{folder.name}-f32.gguf").is_file() or find_converter(None, located) is not None
    )
