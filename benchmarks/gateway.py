"""The smg gateway's cost (issue 30): 32 closed-loop clients through smg's OpenAI-compatible HTTP (the openai SDK,
streamed chat completions) against the same clients on llmserve's own gRPC (llmserve_client, chat input), both on
the one server `python -m llmserve` starts (the default model, its engine process), in windows that alternate
(G L, L G, ...) in one run so that the machine's drift hits both alike.

Every request asks for the same number of new tokens with EOS ignored; a window's throughput is the completion tokens
that arrived inside it over its length (a request's tokens spread evenly over its messages: smg's chunks do not say
how many tokens each holds); time to first token is from the request's start to
its first token (the first content chunk through smg, the first message with tokens on gRPC), for requests started
inside the window.

    python -m benchmarks.gateway [--windows 3] [--window-s 40] [--clients 32]   (make bench-gateway)

Writes benchmarks/results/<date>-cpu-gateway.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.paths import ROOT, child_env, make_importable  # noqa: E402

make_importable()

import openai  # noqa: E402

from llmserve_client import AsyncClient  # noqa: E402

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
        "loadavg_after": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=3, help="pairs of windows (smg, gRPC)")
    parser.add_argument("--window-s", type=float, default=40.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    port, smg_port, smg_metrics = free_port(), free_port(), free_port()
    address = f"127.0.0.1:{port}"
    env = dict(child_env(), LLMSERVE_HISTORY_STORE="memory")
    serve = [sys.executable, "-m", "llmserve", "--address", address, "--log-level", "WARNING"]
    server = subprocess.Popen(serve, env=env)
    smg_env = dict(env, SMG=str(SMG_BINARY), SMG_HOST="127.0.0.1", SMG_PORT=str(smg_port))
    smg_env["SMG_METRICS_PORT"] = str(smg_metrics)
    smg = None
    try:
        asyncio.run(_wait_serving(address))
        launch = ["bash", str(ROOT / "deploy" / "smg" / "launch.sh"), address, "--log-level", "warn"]
        smg = subprocess.Popen(launch, env=smg_env, stdout=subprocess.DEVNULL)
        wait_ready(f"http://127.0.0.1:{smg_port}", 60)
        result = asyncio.run(measure(address, f"http://127.0.0.1:{smg_port}", args))
    finally:
        for proc in (smg, server):
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    write(result, args)


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


def write(result: dict[str, object], args: argparse.Namespace) -> None:
    stamp = datetime.date.today().isoformat()
    out = ROOT / "benchmarks" / "results" / f"{stamp}-cpu-gateway"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    rates, ttft = result["tokens_per_s"], result["ttft_s"]
    assert isinstance(rates, dict) and isinstance(ttft, dict)
    lines = [
        "# The smg gateway: 32 clients through smg's OpenAI HTTP vs llmserve's own gRPC (benchmarks/gateway.py)",
        "",
        f"`python -m benchmarks.gateway --windows {args.windows} --window-s {args.window_s:g}`, under "
        "`flock -x /work/cpu.lock`: SmolLM2-135M float32 on the CPU, served by `python -m llmserve` (engine process), "
        f"smg 1.13.0 by deploy/smg/launch.sh on the same machine; {args.clients} closed-loop clients, "
        f"{args.max_new_tokens} new tokens each (EOS ignored), sampled; windows alternated.",
        "",
        "| window pair | smg (OpenAI HTTP) tok/s | llmserve gRPC tok/s | ratio |",
        "|---|---|---|---|",
    ]
    for i, (g, direct) in enumerate(zip(rates["smg"], rates["grpc"], strict=True)):
        lines.append(f"| {i + 1} | {g:.1f} | {direct:.1f} | {g / direct:.3f} |")
    lines += [
        "",
        f"Median ratio {result['ratio_median']} (target >= 0.9). Time to first token P50 / P99: through smg "
        f"{ttft['smg']['p50']} s / {ttft['smg']['p99']} s ({ttft['smg']['n']} requests), on gRPC "
        f"{ttft['grpc']['p50']} s / {ttft['grpc']['p99']} s ({ttft['grpc']['n']} requests). Load average after: "
        f"{', '.join(f'{x:.1f}' for x in result['loadavg_after'])}.",  # type: ignore[union-attr]
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
