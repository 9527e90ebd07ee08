"""The smg gateway's cost (issue 30): 32 closed-loop clients through smg's OpenAI-compatible HTTP (streamed chat
completions) against the same clients on llmserve's own gRPC (llmserve_client, chat input), both on the one server
`python -m llmserve` starts (the default model, its engine process), in windows that alternate in one run so that
the machine's drift hits all alike.

Through smg two clients are measured: httpx reading the server-sent events as JSON (what the ratio is quoted for: the
gateway's cost, as a load generator like vLLM's benchmark_serving sees it) and the openai SDK on the same httpx
transport (its objects per chunk cost the client ~4x the CPU of llmserve_client's, and the load generator shares the
server's two cores here, so the SDK's ratio carries the SDK's cost too). Each window records the CPU seconds of the
clients, the server's API and engine processes and smg.

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
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import openai
import psutil
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from benchmarks import options, writer
from benchmarks.metrics import ratio
from benchmarks.paths import ROOT
from benchmarks.serve import Server, free_port
from benchmarks.window import Window, spread, ttft_summary, window_ratios
from benchmarks.writer import num
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
# The window order alternates: smg, smg-sdk, grpc, then grpc, smg-sdk, smg, ...: smg (httpx) and gRPC, the pair
# the ratio compares, sit symmetrically around the SDK's window.
MODES = ("smg", "smg-sdk", "grpc")
SMG_BINARY = Path(sys.executable).parent / "smg"


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


class CpuMeter:
    """CPU seconds (user + system, all threads) spent by each side of the run: the load generator's clients (this
    process), the server's API process (`python -m llmserve`: gRPC, both edges, detokenization) and its engine process
    (the step loop, the forward), smg; and the machine's idle seconds. On two cores the clients and smg compete with
    the server, so a gap between the modes is read from these."""

    def __init__(self, server_pid: int, smg: subprocess.Popen[bytes]) -> None:
        root = psutil.Process(server_pid)
        self._roles = {
            "clients": [psutil.Process()],
            "server API": [root],
            "engine": root.children(recursive=True),
            "smg": [psutil.Process(smg.pid)],  # launch.sh execs smg: its pid is smg's
        }

    def read(self) -> dict[str, float]:
        seconds = {role: sum(_cpu_s(p) for p in procs) for role, procs in self._roles.items()}
        seconds["idle"] = psutil.cpu_times().idle
        return seconds


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


@dataclass(slots=True)
class Watched:
    """What a window of this mode records beside its tokens: the CPU seconds each side spent inside it, and samples
    every 0.1 s of the clients' requests in flight and the engine's running and waiting counts."""

    window: Window
    cpu_s: dict[str, float] = field(default_factory=dict)
    occupancy: list[tuple[int, int, int]] = field(default_factory=list)

    async def sample_occupancy(self, address: str) -> None:
        """Where the clients' requests are: the engine's running and waiting counts (the vLLM edge's GetLoads, what
        smg polls) beside the requests the clients have open; a request open but in neither is in a client, smg or
        the edge."""
        window = self.window
        await asyncio.sleep(max(0.0, window.counted_from - time.monotonic()))
        async with grpc.aio.insecure_channel(address) as channel:
            loads = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetLoads
            while not window.over:
                load = (await loads(vllm_engine_pb2.GetLoadsRequest())).loads[0]
                self.occupancy.append((window.open, load.num_running_reqs, load.num_waiting_reqs))
                await asyncio.sleep(0.1)

    async def meter(self, cpu: CpuMeter) -> None:
        """The CPU seconds each side spends inside the window (after its warm-up)."""
        await asyncio.sleep(max(0.0, self.window.counted_from - time.monotonic()))
        before = cpu.read()
        await asyncio.sleep(max(0.0, self.window.end - time.monotonic()))
        after = cpu.read()
        self.cpu_s = {role: after[role] - before[role] for role in after}


async def grpc_client(c: int, window: Window, address: str, args: argparse.Namespace) -> None:
    async with AsyncClient(address, timeout=600) as client:
        for k, question in window.calls(c, QUESTIONS):
            await window.count(
                client.generate(
                    messages=[{"role": "user", "content": question}],
                    max_new_tokens=args.max_new_tokens,
                    ignore_eos=True,
                    temperature=0.7,
                    seed=c * 1000 + k,
                    return_token_ids=True,
                )
            )


async def sdk_client(c: int, window: Window, sdk: openai.AsyncOpenAI, model: str, args: argparse.Namespace) -> None:
    """Through smg with the openai SDK (its pydantic objects per chunk)."""
    for k, question in window.calls(c, QUESTIONS):
        began, arrivals, tokens = window.begin(), [], 0
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
        window.done(began, spread(arrivals, tokens))


async def http_client(c: int, window: Window, http: httpx.AsyncClient, model: str, args: argparse.Namespace) -> None:
    """Through smg on the same HTTP transport as the SDK (httpx), reading the server-sent events as JSON: the
    request a load generator such as vLLM's benchmark_serving sends, without the SDK's object layer."""
    for k, question in window.calls(c, QUESTIONS):
        began, arrivals, tokens = window.begin(), [], 0
        body = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": args.max_new_tokens,
            "temperature": 0.7,
            "seed": c * 1000 + k,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if any(choice["delta"].get("content") for choice in event["choices"]):
                    arrivals.append(time.monotonic())
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        window.done(began, spread(arrivals, tokens))


@dataclass(slots=True)
class Clients:
    """What the three kinds of client talk through: smg's HTTP (the SDK, or httpx alone) and llmserve's gRPC."""

    address: str
    model: str
    sdk: openai.AsyncOpenAI
    http: httpx.AsyncClient


async def run_window(mode: str, clients: Clients, cpu: CpuMeter, args: argparse.Namespace) -> Watched:
    window = Window.starting_now(args.warmup_s, args.window_s)
    watched = Watched(window)
    if mode == "smg":
        loops = [http_client(c, window, clients.http, clients.model, args) for c in range(args.clients)]
    elif mode == "smg-sdk":
        loops = [sdk_client(c, window, clients.sdk, clients.model, args) for c in range(args.clients)]
    else:
        loops = [grpc_client(c, window, clients.address, args) for c in range(args.clients)]
    await asyncio.gather(watched.meter(cpu), watched.sample_occupancy(clients.address), *loops)
    return watched


async def measure(address: str, smg_url: str, cpu: CpuMeter, args: argparse.Namespace) -> dict[str, object]:
    sdk = openai.AsyncOpenAI(base_url=smg_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await sdk.models.list()).data[0].id
    async with AsyncClient(address, timeout=30) as client:
        info = await client.model_info()
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    http = httpx.AsyncClient(base_url=smg_url, timeout=600, limits=limits)
    clients = Clients(address, model, sdk, http)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    ttfts: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu_s: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    occupancy: dict[str, list[tuple[int, int, int]]] = {mode: [] for mode in MODES}
    for i in range(args.windows):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            watched = await run_window(mode, clients, cpu, args)
            rates[mode].append(watched.window.tokens_per_s)
            ttfts[mode] += watched.window.ttfts
            cpu_s[mode].append(watched.cpu_s)
            occupancy[mode] += watched.occupancy
        print(json.dumps({k: [round(r, 1) for r in v] for k, v in rates.items()}), flush=True)
    await http.aclose()
    await sdk.close()
    ratios, median = window_ratios(rates["smg"], rates["grpc"])
    sdk_ratios, sdk_median = window_ratios(rates["smg-sdk"], rates["grpc"])
    return {
        "served": {"model": info.name, "dtype": info.dtype, "device": info.device},
        "clients": args.clients,
        "max_new_tokens": args.max_new_tokens,
        "window_s": args.window_s,
        "tokens_per_s": rates,
        "ratio_per_window_set": ratios,
        "ratio_median": median,
        "sdk_ratio_per_window_set": sdk_ratios,
        "sdk_ratio_median": sdk_median,
        "ttft_s": {mode: ttft_summary(v) for mode, v in ttfts.items()},
        # Means over the samples: requests the clients had open, the engine ran, the engine queued.
        "occupancy": {mode: _means(samples) for mode, samples in occupancy.items()},
        "cpu_s_per_window": {mode: [{k: round(v, 2) for k, v in w.items()} for w in ws] for mode, ws in cpu_s.items()},
        # Median over the mode's windows: the cores each side kept busy (idle: the cores nobody used), and the CPU
        # milliseconds each side spent per completion token.
        "cpu_cores": {mode: _median_per_role(ws, [args.window_s] * len(ws)) for mode, ws in cpu_s.items()},
        "cpu_ms_per_token": {
            mode: _median_per_role(ws, [r * args.window_s / 1000 for r in rates[mode]], skip=("idle",))
            for mode, ws in cpu_s.items()
        },
    }


def _means(samples: list[tuple[int, int, int]]) -> dict[str, float]:
    columns = zip(*samples, strict=True) if samples else ((), (), ())
    return {
        k: round(statistics.fmean(c), 2) if c else float("nan")
        for k, c in zip(("open", "running", "waiting"), columns, strict=True)
    }


def _median_per_role(
    windows: list[dict[str, float]], per: list[float], skip: tuple[str, ...] = ()
) -> dict[str, float | None]:
    """Each role's median over the windows of its CPU seconds divided by the window's `per` (None where every `per`
    is 0: no tokens in any of the mode's windows, as in a smoke run on a loaded machine)."""
    roles = [role for role in windows[0] if role not in skip] if windows else []
    out: dict[str, float | None] = {}
    for role in roles:
        values = [w[role] / d for w, d in zip(windows, per, strict=True) if d]
        out[role] = round(statistics.median(values), 3) if values else None
    return out


def main(argv: list[str]) -> int:
    p = options.parser("gateway", __doc__)
    sets = "smg with httpx, smg with the SDK, gRPC"
    options.add_windows(p, sets, window_s=30.0, warmup_s=8.0, max_new_tokens=64)
    args = options.parse_windows(p, argv)
    run = writer.Run(options.command("gateway", argv))
    smg_port, smg_metrics = free_port(), free_port()
    smg_env = dict(os.environ, SMG=str(SMG_BINARY), SMG_HOST="127.0.0.1", SMG_PORT=str(smg_port))
    smg_env["SMG_METRICS_PORT"] = str(smg_metrics)
    smg = None
    with Server(model=args.model, device=args.device, dtype=args.dtype) as server:
        try:
            asyncio.run(server.wait_serving())
            launch = ["bash", str(ROOT / "deploy" / "smg" / "launch.sh"), server.address, "--log-level", "warn"]
            smg = subprocess.Popen(launch, env=smg_env, stdout=subprocess.DEVNULL)
            wait_ready(f"http://127.0.0.1:{smg_port}", 60)
            cpu = CpuMeter(server.pid, smg)
            figures = asyncio.run(measure(server.address, f"http://127.0.0.1:{smg_port}", cpu, args))
            run.model = figures.pop("served")  # type: ignore[assignment]
        finally:
            if smg is not None:
                smg.terminate()
                smg.wait(60)
    writer.publish(run, args.out_dir, options.result_name(args, "gateway"), TITLE, figures, section)
    return 0


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    rates, ttft = result["tokens_per_s"], result["ttft_s"]
    lines = [
        f"Served by `python -m llmserve` (engine process), smg 1.13.0 by deploy/smg/launch.sh on the same machine; "
        f"{result['clients']} closed-loop clients, {result['max_new_tokens']} new tokens each (EOS ignored, sampled), "
        f"windows of {result['window_s']:g} s in sets alternated (H S G, G S H, ...): H through smg's OpenAI HTTP "
        "with httpx reading the events as JSON, S the same through the openai SDK, G llmserve_client on gRPC. "
        "The load generator runs on the server's cores.",
        "",
    ]
    sets = zip(rates["smg"], rates["smg-sdk"], rates["grpc"], strict=True)
    rows = [
        [i + 1, f"{http:.1f}", f"{sdk:.1f}", f"{direct:.1f}", num(ratio(http, direct), 3), num(ratio(sdk, direct), 3)]
        for i, (http, sdk, direct) in enumerate(sets)
    ]
    header = ["window set", "smg, httpx tok/s", "smg, openai SDK tok/s", "gRPC tok/s", "ratio httpx", "ratio SDK"]
    lines += writer.table(header, rows)
    lines += [
        "",
        f"Median ratio {result['ratio_median']} through smg with httpx (target >= 0.9), {result['sdk_ratio_median']} "
        "with the openai SDK as the client. Time to first token P50 / P99: "
        + "; ".join(f"{mode} {t['p50']} s / {t['p99']} s ({t['n']} requests)" for mode, t in ttft.items())
        + ".",
        "",
        "Where the requests were (means of samples every 0.1 s): open at the clients, running in the engine, "
        "waiting in the engine: "
        + "; ".join(f"{mode} {o['open']} / {o['running']} / {o['waiting']}" for mode, o in result["occupancy"].items())
        + ".",
        "",
        "Where the CPU went (medians over each mode's windows): cores kept busy, and CPU ms per completion token.",
        "",
    ]
    cores, per_token = result["cpu_cores"], result["cpu_ms_per_token"]
    rows = [
        [role] + [num(cores[mode][role], 2) for mode in MODES] + [num(per_token[mode].get(role), 3) for mode in MODES]
        for role in cores["grpc"]
    ]
    header = ["process"] + [f"cores, {mode}" for mode in MODES] + [f"ms/token, {mode}" for mode in MODES]
    return lines + writer.table(header, rows)
