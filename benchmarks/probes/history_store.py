"""What a durable history store costs a continuing turn (issue 23): memory vs sqlite vs redis, same run.

Three servers in this process, identical but for --history-store (memory; sqlite on a temporary file; a
redis-server started here on a loopback port with persistence off), each over its own engine on the same model.
One client runs S sessions × T append-mode turns against each, alternating the store at every turn (and
rotating which store goes first) so that drift in the machine's load falls on all three alike. Measured per
store: the client's TTFT (the store's `start` is on it: read the history, take the lease) and the call's
duration (the `commit` is on it, before the last message) of every continuing turn, P50 and P90.

    python -m benchmarks.probes.history_store [--sessions 12] [--turns 8] [--model random:tiny] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from llmserve.app import LLMServer
from llmserve.config import ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.config import EngineConfig
from llmserve.history import HistoryConfig
from llmserve.models import load_model
from llmserve_client import NO_RETRY, AsyncClient, build_request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (make redis)")
    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit("redis-server did not start")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(args.model, device="cpu", dtype="float32")
    folder = tempfile.TemporaryDirectory()
    redis, url = _start_redis()
    stores = {"memory": "memory", "sqlite": f"sqlite:{Path(folder.name) / 'sessions.db'}", "redis": url}
    servers: dict[str, LLMServer] = {}
    clients: dict[str, AsyncClient] = {}
    engine_config = EngineConfig(kv_cache_tokens=32768, max_num_seqs=8, cuda_graphs=False)
    try:
        for name, spec in stores.items():
            config = ServerConfig(address="127.0.0.1:0", reflection=False, history=HistoryConfig(store=spec))
            server = servers[name] = LLMServer(config)
            await server.start()
            await server.serve(AsyncEngine(loaded, engine_config))
            clients[name] = AsyncClient(f"127.0.0.1:{server.port}", retry=NO_RETRY)
        ttft: dict[str, list[float]] = {name: [] for name in stores}
        total: dict[str, list[float]] = {name: [] for name in stores}
        order = list(stores)
        for s in range(args.sessions):
            sid = f"bench-{s}"
            for t in range(args.turns):
                for name in order:
                    new = [100 + (7 * s + 3 * t + k) % 5000 for k in range(args.new_tokens if t else 64)]
                    request = build_request(
                        token_ids=new,
                        session_id=sid,
                        continue_session=t > 0,
                        max_new_tokens=args.answer,
                        ignore_eos=True,
                        return_token_ids=True,
                    )
                    began = time.perf_counter()
                    first = None
                    async for response in clients[name].generate(request):
                        if first is None and response.token_ids:
                            first = time.perf_counter()
                    end = time.perf_counter()
                    if t > 0:
                        ttft[name].append((first or end) - began)
                        total[name].append(end - began)
                order = order[1:] + order[:1]
        result: dict[str, Any] = {
            "command": "python -m benchmarks.probes.history_store " + " ".join(args.argv),
            "model": args.model,
            "sessions": args.sessions,
            "turns": args.turns,
            "continuing_turns_per_store": len(ttft["memory"]),
            "answer_tokens": args.answer,
            "stores": {},
        }
        for name in stores:
            result["stores"][name] = {
                "ttft_p50_ms": 1000 * statistics.median(ttft[name]),
                "ttft_p90_ms": 1000 * _pct(ttft[name], 0.9),
                "call_p50_ms": 1000 * statistics.median(total[name]),
                "call_p90_ms": 1000 * _pct(total[name], 0.9),
            }
        base = result["stores"]["memory"]
        for name in ("sqlite", "redis"):
            row = result["stores"][name]
            row["ttft_p50_added_ms"] = row["ttft_p50_ms"] - base["ttft_p50_ms"]
            row["call_p50_added_ms"] = row["call_p50_ms"] - base["call_p50_ms"]
        return result
    finally:
        for client in clients.values():
            await client.close()
        for server in servers.values():
            await server.stop(0)
        redis.kill()
        redis.wait()
        folder.cleanup()


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# History store cost: a continuing turn with memory vs sqlite vs redis",
        "",
        f"`{result['command']}` — model `{result['model']}`, {result['continuing_turns_per_store']} continuing "
        f"turns per store ({result['sessions']} sessions × {result['turns'] - 1} continuing turns, "
        f"{result['answer_tokens']} answer tokens), the store alternated at every turn, one client.",
        "",
        "| store | TTFT P50 (ms) | TTFT P90 (ms) | added at P50 (ms) | call P50 (ms) | call added at P50 (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in result["stores"].items():
        added = f"{row['ttft_p50_added_ms']:+.2f}" if "ttft_p50_added_ms" in row else "—"
        call_added = f"{row['call_p50_added_ms']:+.2f}" if "call_p50_added_ms" in row else "—"
        lines.append(
            f"| {name} | {row['ttft_p50_ms']:.2f} | {row['ttft_p90_ms']:.2f} | {added} | {row['call_p50_ms']:.2f} "
            f"| {call_added} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--answer", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="write PATH.json and PATH.md")
    parsed = parser.parse_args()
    parsed.argv = sys.argv[1:]
    outcome = asyncio.run(main(parsed))
    print(json.dumps(outcome, indent=2))
    if parsed.out is not None:
        parsed.out.with_suffix(".json").write_text(json.dumps(outcome, indent=2) + "\n")
        parsed.out.with_suffix(".md").write_text(_markdown(outcome))
