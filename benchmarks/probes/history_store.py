"""What a durable history store costs a continuing turn (issue 23): memory vs sqlite vs redis, same run.

Three servers in this process, identical but for --history-store (memory; sqlite on a temporary file; a
redis-server started here on a loopback port with persistence off), each over its own engine on the same model.
One client runs S sessions × T append-mode turns against each, alternating the store at every turn (and
rotating which store goes first) so that drift in the machine's load falls on all three alike. Measured per
store: the client's TTFT (the store's `start` is on it: read the history, take the lease) and the call's
duration (the `commit` is on it, before the last message) of every continuing turn, P50 and P90.

    python benchmarks/run.py --mode history-store [--sessions 12] [--turns 8] [--model random:tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import options, writer
from benchmarks.systems.grpc_e2e import free_port
from llmserve.app import LLMServer
from llmserve.config import ServerConfig
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.history import HistoryConfig
from llmserve.models import load_model
from llmserve_client import NO_RETRY, AsyncClient, build_request

TITLE = "History store cost: a continuing turn with memory vs sqlite vs redis"


def _start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (make redis)")
    port = free_port()
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


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
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


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    lines = [
        f"Model `{result['model']}`, {result['continuing_turns_per_store']} continuing turns per store "
        f"({result['sessions']} sessions × {result['turns'] - 1} continuing turns, {result['answer_tokens']} answer "
        "tokens), the store alternated at every turn, one client.",
        "",
    ]
    rows = [
        [
            name,
            f"{row['ttft_p50_ms']:.2f}",
            f"{row['ttft_p90_ms']:.2f}",
            f"{row['ttft_p50_added_ms']:+.2f}" if "ttft_p50_added_ms" in row else "—",
            f"{row['call_p50_ms']:.2f}",
            f"{row['call_p50_added_ms']:+.2f}" if "call_p50_added_ms" in row else "—",
        ]
        for name, row in result["stores"].items()
    ]
    header = ["store", "TTFT P50 (ms)", "TTFT P90 (ms)", "added at P50 (ms)", "call P50 (ms)"]
    return lines + writer.table([*header, "call added at P50 (ms)"], rows)


def main(argv: list[str]) -> int:
    p = options.parser("history-store", __doc__)
    p.set_defaults(model="random:tiny")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--answer", type=int, default=8)
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns = 2, 3
    run = writer.Run(options.command("history-store", argv))
    figures = asyncio.run(measure(args))
    writer.publish(run, args.out_dir, options.result_name(args, "history-store"), TITLE, figures, section)
    return 0
