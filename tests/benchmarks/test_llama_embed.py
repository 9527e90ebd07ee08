"""benchmarks/systems/llama_embed.py against a stand-in llama-server (http.server over kept-alive HTTP/1.1 that answers
/health and /v1/embeddings with made-up base64 vectors, in reverse order, and closes every third request's connection
as llama-server closes its hundredth): the server's flags, the vectors put back in order, a caller's connection kept
and opened again where the server closed it, and why the peer is skipped where llama.cpp or its converter is absent."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.systems import llama_embed
from benchmarks.systems.llama_embed import Connection, LlamaEmbedServer, Located

STAND_IN = """\
import base64, http.server, json, struct, sys
argv = sys.argv[1:]
opened = []
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def setup(self):
        super().setup()
        self.served = 0
    def log_message(self, *args):
        pass
    def answer(self, body):
        self.served += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        if self.served % 3 == 0:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.answer(b"{}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        opened.extend([1] if self.served == 0 else [])  # connections that carried a POST
        if self.path == "/stats":
            return self.answer(json.dumps({"connections": len(opened)}).encode())
        rows = [{"index": k, "embedding": base64.b64encode(struct.pack("<2f", len(t), k)).decode()}
                for k, t in enumerate(body["input"])]
        self.answer(json.dumps({"data": rows[::-1]}).encode())
port = int(argv[argv.index("--port") + 1])
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[LlamaEmbedServer]:
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n{STAND_IN}")
    path.chmod(0o755)
    server = LlamaEmbedServer(Located(path, tmp_path / "m.gguf"), 4, tmp_path / "log", threads=2)
    server.start()
    yield server
    server.stop()


def test_a_caller_keeps_its_connection_until_the_server_closes_it_and_gets_its_vectors_in_order(
    peer: LlamaEmbedServer,
) -> None:
    command = peer.command
    assert command[command.index("-np") + 1] == "4" and command[command.index("-c") + 1] == "2048"
    assert command[-3:] == ["--embedding", "--pooling", "mean"]

    async def go() -> tuple[list[np.ndarray], dict]:
        connection = Connection(peer.server.port)
        try:
            answers = [await llama_embed.embed(connection, ["a", "bb", "ccc"][: k + 1]) for k in range(3)]
            answers += [await llama_embed.embed(connection, ["dddd"]) for _ in range(4)]
            stats = await connection.post("/stats", {})
        finally:
            connection.close()
        return answers, json.loads(stats)

    answers, stats = asyncio.run(go())
    assert answers[2].tolist() == [[1, 0], [2, 1], [3, 2]] and answers[3].tolist() == [[4, 0]]
    assert stats["connections"] == 3  # 8 requests, each connection closed by the server after its third


def test_a_window_counts_the_texts_its_callers_got(peer: LlamaEmbedServer) -> None:
    window = peer.window([f"text {k}" for k in range(10)], 3, 4, 0.0, 0.5)
    assert window.tokens > 0 and len(window.ttfts) > 0 and window.open == 0


def test_the_peer_is_skipped_naming_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LLAMA_SERVER", "LLAMA_CPP_BIN", "LLAMA_CPP_CONVERT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("LLMSERVE_BENCH_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "all-MiniLM-L6-v2"
    assert "no llama-server" in (llama_embed.locate(folder, None, None, None).skipped or "")
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    skipped = llama_embed.locate(folder, str(binary), None, None).skipped or ""
    assert "no convert_hf_to_gguf.py" in skipped and "all-MiniLM-L6-v2-f32.gguf" in skipped
    assert "all-MiniLM-L6-v2-f16.gguf" in (llama_embed.locate(folder, str(binary), None, None, "f16").skipped or "")
    given = llama_embed.locate(folder, str(binary), None, str(tmp_path / "given.gguf"))
    assert given.skipped is None and given.gguf == tmp_path / "given.gguf"
    monkeypatch.setenv("LLAMA_CPP_BIN", str(binary.parent))
    assert llama_embed.locate(folder, None, None, str(tmp_path / "given.gguf")).binary == binary
