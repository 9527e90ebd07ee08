"""benchmarks/systems/llama_cpp.py against a stand-in llama-server (a few lines of http.server that answer /health
and stream /completion's events): one slot per client of each client count, restarted between client counts, each
start's command kept; a server that dies at start started again with --no-repack; tokens stamped one by one."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from benchmarks.loadgen import RequestRecord
from benchmarks.systems.llama_cpp import LlamaCppSystem
from benchmarks.workload import BenchRequest

STAND_IN = """\
import http.server, json, os, sys, time
argv = sys.argv[1:]
if os.environ.get("STAND_IN_DIES") and "--no-repack" not in argv:
    sys.exit(132)
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.end_headers()
        for token in range(body["n_predict"]):
            time.sleep(0.01)
            self.wfile.write(b"data: " + json.dumps({"tokens": [token]}).encode() + b"\\n\\n")
            self.wfile.flush()
        self.wfile.write(b'data: {"stop": true, "tokens": []}\\n\\n')
port = int(argv[argv.index("--port") + 1])
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n{STAND_IN}")
    path.chmod(0o755)
    return path


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_server_is_restarted_with_one_slot_per_client_of_each_client_count(stand_in: Path, tmp_path: Path) -> None:
    system = LlamaCppSystem(stand_in, tmp_path / "m.gguf", "Q8_0", 1, 384, tmp_path / "log", 2, per_clients=True)

    async def go() -> tuple[list[int], RequestRecord]:
        await system.start()
        pids = [system.memory_pid()]
        try:
            await system.prepare(1)  # the slots it has: no restart
            pids.append(system.memory_pid())
            await system.prepare(4)
            pids.append(system.memory_pid())
            record = RequestRecord("r", 2, 0.0)
            await system.generate(BenchRequest("r", (5, 6), 5), record)
        finally:
            await system.stop()
        return pids, record

    pids, record = asyncio.run(go())
    assert pids[0] == pids[1] != pids[2]
    assert sorted(system.commands) == [1, 4] and sorted(system.start_s) == [1, 4]
    assert (flag(system.commands[1], "-np"), flag(system.commands[1], "-c")) == ("1", "384")
    assert (flag(system.commands[4], "-np"), flag(system.commands[4], "-c")) == ("4", "1536")
    assert flag(system.commands[4], "-t") == flag(system.commands[4], "-tb") == "2"
    assert "--no-repack" not in system.commands[4] and not system.no_repack
    assert record.finished and len(record.token_times) == 5 and record.token_times == sorted(record.token_times)


def test_without_per_clients_the_slots_stay_and_a_server_that_dies_at_start_runs_without_repacking(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAND_IN_DIES", "1")
    system = LlamaCppSystem(stand_in, tmp_path / "m.gguf", "Q8_0", 32, 100, tmp_path / "log")

    async def go() -> int:
        await system.start()
        try:
            pid = system.memory_pid()
            await system.prepare(1)
            return pid - system.memory_pid()
        finally:
            await system.stop()

    assert asyncio.run(go()) == 0  # the same process
    assert system.no_repack and list(system.commands) == [32]
    assert system.commands[32][-1] == "--no-repack" and flag(system.commands[32], "-np") == "32"
