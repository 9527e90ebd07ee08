"""How many tokens a second the serving path carries when the model costs nothing: in-process vs over gRPC.

The real engine (scheduler, step thread, sampling, the per-step hand-off to the event loop) over a 2-layer tiny
Llama whose model call is stubbed out (benchmarks/probes/host_overhead.py's stub: ready logits), so the figures are the
host side's ceiling: what the engine, the service and gRPC can carry whatever the device. `--streams` closed-loop
streams each ask for `--tokens` token ids (ids in, ids out, no tokenizer) again and again; in-process they are
consumed on an event loop with `AsyncEngine.generate`, over gRPC by a client in a process of its own (grpc.aio)
talking to an LLMServer in this one. The two alternate, `--rounds` times each; tokens/s over each window after a
one-second warm-up.

    python benchmarks/run.py --mode frontend [--streams 256] [--tokens 128] [--seconds 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.paths import ROOT, child_env
from benchmarks.probes.host_overhead import VOCAB, stub_model_call
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config
from tests.testing import tiny_config

PROMPT = tuple(range(1, 17))
WARM_UP_S = 1.0


def stubbed_engine(streams: int, tokens: int) -> AsyncEngine:
    loaded = from_config(tiny_config("llama", vocab_size=VOCAB, max_positions=4096), dtype=torch.float32)
    config = EngineConfig(
        block_size=16,
        kv_cache_tokens=streams * (len(PROMPT) + tokens + 32) + 1024,
        max_num_seqs=streams,
        max_num_batched_tokens=max(512, streams * 2),
        cuda_graphs=False,
    )
    engine = AsyncEngine(loaded, config)
    stub_model_call(engine.core.engine_core)  # type: ignore[attr-defined]
    return engine


class _Count:
    """Tokens received after the warm-up, until the window closes."""

    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic() + WARM_UP_S
        self.end = self.start + seconds
        self.tokens = 0

    def add(self, n: int) -> None:
        if self.start <= time.monotonic() < self.end:
            self.tokens += n


async def _in_process(engine: AsyncEngine, streams: int, tokens: int, seconds: float) -> float:
    count = _Count(seconds)

    async def stream(i: int) -> None:
        n = 0
        while time.monotonic() < count.end:
            n += 1
            request = GenerationRequest(f"s{i}-{n}", PROMPT, stopping=StoppingParams(tokens, ignore_eos=True))
            async for delta in engine.generate(request):
                count.add(len(delta.token_ids))

    await asyncio.gather(*(stream(i) for i in range(streams)))
    return count.tokens / seconds


async def _client(address: str, streams: int, tokens: int, seconds: float) -> float:
    """The gRPC side's load: `streams` closed-loop streams on one grpc.aio channel."""
    import grpc

    from llmserve_client import build_request
    from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

    count = _Count(seconds)
    request = build_request(token_ids=list(PROMPT), max_new_tokens=tokens, ignore_eos=True, return_token_ids=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        async def stream() -> None:
            while time.monotonic() < count.end:
                async for response in stub.Generate(request, timeout=120):
                    count.add(len(response.token_ids))

        await asyncio.gather(*(stream() for _ in range(streams)))
    return count.tokens / seconds


def _over_grpc(engine: AsyncEngine, streams: int, tokens: int, seconds: float) -> float:
    from tests.testing import ServerThread  # an LLMServer on a loopback port, on a loop of its own

    server = ServerThread(engine, max_concurrent_streams=max(1024, streams)).start()
    try:
        args = ["--client", server.address, "--streams", str(streams), "--tokens", str(tokens)]
        out = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "run.py"),
                "--mode",
                "frontend",
                *args,
                "--seconds",
                str(seconds),
            ],
            cwd=ROOT,
            env=child_env(),
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return float(out.strip().splitlines()[-1])
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/run.py --mode frontend", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--seconds", type=float, default=10.0, help="measurement window")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # the gRPC side's load generator
    args = p.parse_args(argv)
    if args.client:
        print(asyncio.run(_client(args.client, args.streams, args.tokens, args.seconds)))
        return 0
    torch.set_num_threads(1)
    results: dict[str, list[float]] = {"in-process": [], "grpc": []}
    for _ in range(args.rounds):
        engine = stubbed_engine(args.streams, args.tokens)

        async def in_process(engine: AsyncEngine = engine) -> float:
            await engine.start()
            try:
                return await _in_process(engine, args.streams, args.tokens, args.seconds)
            finally:
                await engine.shutdown()

        results["in-process"].append(asyncio.run(in_process()))
        results["grpc"].append(
            _over_grpc(stubbed_engine(args.streams, args.tokens), args.streams, args.tokens, args.seconds)
        )
        print(f"in-process {results['in-process'][-1]:,.0f} tok/s, over gRPC {results['grpc'][-1]:,.0f} tok/s")
    local, remote = statistics.median(results["in-process"]), statistics.median(results["grpc"])
    print(f"median: in-process {local:,.0f}, over gRPC {remote:,.0f} tok/s ({remote / local:.0%} of in-process)")
    if args.json:
        args.json.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, **results}, indent=2))
    return 0
