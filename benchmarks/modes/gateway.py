"""The smg gateway's cost (issue 30): 32 closed-loop clients through smg's OpenAI-compatible HTTP (the openai SDK,
streamed chat completions) against the same clients on llmserve's own gRPC (llmserve_client, chat input), both on
the one server `python -m llmserve` starts (the default model, its engine process), in windows that alternate
(G L, L G, ...) in one run so that the machine's drift hits both alike.

Every request asks for the same number of new tokens with EOS ignored; a window's throughput is the completion tokens
that arrived inside it over its length (a request's tokens spread evenly over its messages: smg's chunks do not say
how many tokens each holds); time to first token is from the request's start to
its first token (the first content chunk through smg, the first message with tokens on gRPC), for requests started
inside the window.

    python benchmarks/run.py --mode gateway [--windows 3] [--window-s 30] [--clients 32] [--quick]

Writes benchmarks/results/<date>-cpu-gateway.{md,json} (`make bench-gateway`). --model, --device and --dtype go to
the server; the model needs a tokenizer (smg tokenizes), so not a random:* one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai

from benchmarks import options, writer
from benchmarks.paths import ROOT, child_env
from llmserve_client import AsyncClient

TITLE = "The smg gateway: its OpenAI HTTP vs llmserve's own gRPC, 32 clients (issue 30)"
QUESTIONS = [
    "Tell me about the history of the bicycle.",
    "Explain how a refrigerator works.",
    "Write a short story about a lighthouse keeper.",
    "What should I pack for a week of hiking?",
    "Describe the water cycle to a ten-year-old.",
    "Give me ideas for a birthday party in the garden.",
]
SMG_BINARY = Path(sys.executable).parent / "smg"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, timeout_s: float) -> None:
    """smg ready: /readiness answers 200 once its workers' tokenizers are loaded."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url + "/readiness", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


class Window:
    def __init__(self, start: float, warmup_s: float, window_s: float) -> None:
        self.counted_from = start + warmup_s
        self.end = self.counted_from + window_s
        self.tokens = 0.0
        self.ttfts: list[float] = []

    def done(self, began: float, arrivals: list[float], tokens: int) -> None:
        """A finished request: its messages' arrival times and its completion tokens (spread evenly over them)."""
        inside = sum(self.counted_from <= t < self.end for t in arrivals)
        if arrivals:
            self.tokens += tokens * inside / len(arrivals)
            if self.counted_from <= began < self.end:
                self.ttfts.append(arrivals[0] - began)


async def grpc_client(c: int, window: Window, address: str, args: argparse.Namespace) -> None:
    async with AsyncClient(address, timeout=600) as client:
        k = 0
        while time.monotonic() < window.end:
            question = QUESTIONS[(c + k) % len(QUESTIONS)]
            k += 1
            began, arrivals, tokens = time.monotonic(), [], 0
            async for response in client.generate(
                messages=[{"role": "user", "content": question}],
                max_new_tokens=args.max_new_tokens,
                ignore_eos=True,
                temperature=0.7,
                seed=c * 1000 + k,
                return_token_ids=True,
            ):
                if response.token_ids:
                    arrivals.append(time.monotonic())
                tokens += len(response.token_ids)
            window.done(began, arrivals, tokens)


async def smg_client(c: int, window: Window, sdk: openai.AsyncOpenAI, model: str, args: argparse.Namespace) -> None:
    k = 0
    while time.monotonic() < window.end:
        question = QUESTIONS[(c + k) % len(QUESTIONS)]
        k += 1
        began, arrivals, tokens = time.monotonic(), [], 0
        stream = await sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=args.max_new_tokens,
            temperature=0.7,
            seed=c * 1000 + k,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for event in stream:
            if any(choice.delta.content for choice in event.choices):
                arrivals.append(time.monotonic())
            if event.usage is not None:
                tokens = event.usage.completion_tokens
        window.done(began, arrivals, tokens)


async def run_window(mode: str, address: str, sdk: openai.AsyncOpenAI, model: str, args: argparse.Namespace) -> Window:
    window = Window(time.monotonic(), args.warmup_s, args.window_s)
    if mode == "smg":
        await asyncio.gather(*(smg_client(c, window, sdk, model, args) for c in range(args.clients)))
    else:
        await asyncio.gather(*(grpc_client(c, window, address, args) for c in range(args.clients)))
    return window


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def measure(address: str, smg_url: str, args: argparse.Namespace) -> dict[str, object]:
    sdk = openai.AsyncOpenAI(base_url=smg_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await sdk.models.list()).data[0].id
    async with AsyncClient(address, timeout=30) as client:
        info = await client.model_info()
    rates: dict[str, list[float]] = {"smg": [], "grpc": []}
    ttfts: dict[str, list[float]] = {"smg": [], "grpc": []}
    for i in range(args.windows):
        for mode in ("smg", "grpc") if i % 2 == 0 else ("grpc", "smg"):
            window = await run_window(mode, address, sdk, model, args)
            rates[mode].append(window.tokens / args.window_s)
            ttfts[mode] += window.ttfts
        print(json.dumps({k: [round(r, 1) for r in v] for k, v in rates.items()}), flush=True)
    ratios = [via / direct for via, direct in zip(rates["smg"], rates["grpc"], strict=True)]
    return {
        "served": {"model": info.name, "dtype": info.dtype, "device": info.device},
        "clients": args.clients,
        "max_new_tokens": args.max_new_tokens,
        "window_s": args.window_s,
        "tokens_per_s": rates,
        "ratio_per_window_pair": [round(r, 3) for r in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "ttft_s": {
            mode: {"p50": round(percentile(v, 0.5), 3), "p99": round(percentile(v, 0.99), 3), "n": len(v)}
            for mode, v in ttfts.items()
        },
    }


def main(argv: list[str]) -> int:
    p = options.parser("gateway", __doc__)
    p.add_argument("--windows", type=int, default=3, help="pairs of windows (smg, gRPC)")
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.quick:  # one pair of short windows, few clients and tokens: a smoke run
        args.windows, args.window_s, args.warmup_s, args.clients, args.max_new_tokens = 1, 3.0, 1.0, 4, 8
    run = writer.Run(options.command("gateway", argv))
    port, smg_port, smg_metrics = free_port(), free_port(), free_port()
    address = f"127.0.0.1:{port}"
    env = dict(child_env(), LLMSERVE_HISTORY_STORE="memory")
    serve = [sys.executable, "-m", "llmserve", "--address", address, "--log-level", "WARNING"]
    serve += ["--device", args.device, "--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    server = subprocess.Popen(serve, env=env)
    smg_env = dict(env, SMG=str(SMG_BINARY), SMG_HOST="127.0.0.1", SMG_PORT=str(smg_port))
    smg_env["SMG_METRICS_PORT"] = str(smg_metrics)
    smg = None
    try:
        asyncio.run(_wait_serving(address))
        launch = ["bash", str(ROOT / "deploy" / "smg" / "launch.sh"), address, "--log-level", "warn"]
        smg = subprocess.Popen(launch, env=smg_env, stdout=subprocess.DEVNULL)
        wait_ready(f"http://127.0.0.1:{smg_port}", 60)
        figures = asyncio.run(measure(address, f"http://127.0.0.1:{smg_port}", args))
        run.model = figures.pop("served")  # type: ignore[assignment]
    finally:
        for proc in (smg, server):
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    writer.publish(run, args.out_dir, options.result_name(args, "gateway"), TITLE, figures, section)
    return 0


async def _wait_serving(address: str) -> None:
    end = time.monotonic() + 300
    async with AsyncClient(address, timeout=5) as client:
        while time.monotonic() < end:
            try:
                if await client.health() == "SERVING":
                    return
            except Exception:  # not listening yet
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(address)


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    rates, ttft = result["tokens_per_s"], result["ttft_s"]
    lines = [
        f"Served by `python -m llmserve` (engine process), smg 1.13.0 by deploy/smg/launch.sh on the same machine; "
        f"{result['clients']} closed-loop clients, {result['max_new_tokens']} new tokens each (EOS ignored, sampled), "
        f"windows of {result['window_s']:g} s alternated (G L, L G, ...).",
        "",
    ]
    pairs = zip(rates["smg"], rates["grpc"], strict=True)
    rows = [[i + 1, f"{via:.1f}", f"{direct:.1f}", f"{via / direct:.3f}"] for i, (via, direct) in enumerate(pairs)]
    lines += writer.table(["window pair", "smg (OpenAI HTTP) tok/s", "llmserve gRPC tok/s", "ratio"], rows)
    smg, grpc = ttft["smg"], ttft["grpc"]
    return lines + [
        "",
        f"Median ratio {result['ratio_median']} (target >= 0.9). Time to first token P50 / P99: through smg "
        f"{smg['p50']} s / {smg['p99']} s ({smg['n']} requests), on gRPC {grpc['p50']} s / {grpc['p99']} s "
        f"({grpc['n']} requests).",
    ]
