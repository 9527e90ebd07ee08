"""Speculative decoding's gain (issue 33): the server `make run` starts, with `--speculative off` and with it on, on
three workloads at 1, 4 and 32 clients.

Two servers (`python -m llmserve`, each with its engine process, the default model) run side by side; only one is
sent requests at a time. For each workload and client count, windows alternate between them (off on, on off, ...)
so that the machine's drift hits both alike. Clients are closed-loop over gRPC (llmserve_client, chat messages, the
server's chat template), greedy, answers ending as they end (EOS, or the schema complete) or at --max-new-tokens.
The workloads (benchmarks/spec_workloads.py): (a) `edit`, rewriting, summarising or commenting a given text (high
overlap with the prompt); (b) `json`, JSON-schema answers (the schema sent as the request's constraint); (c) `chat`,
open questions.

Per window: the output tokens that arrived inside it over its length (all clients: tokens/s; per client: per-stream
tokens/s) and each finished request's decode rate (tokens after the first over the time from the first to the last).
From the speculating server's metrics (scraped before and after each window): drafts proposed and accepted, tokens
emitted by verifying sequences, sequence-steps by drafts chosen, and the decoding steps the load rule left off.

    python benchmarks/run.py --mode speculative [--windows 2] [--window-s 15] [--clients 1,4,32] [--quick]

Writes benchmarks/results/<date>-<device>-speculative.{md,json}. --model, --device and --dtype go to the servers (the
model needs a tokenizer: the prompts are chat messages).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

from benchmarks import options, spec_workloads, writer
from benchmarks.modes.gateway import _wait_serving, free_port
from benchmarks.paths import child_env
from llmserve_client import AsyncClient

TITLE = "Speculative decoding: with vs without, three workloads, 1-32 clients over gRPC (issue 33)"
WORKLOADS = ("edit", "json", "chat")
SPEC_COUNTERS = ("proposed_tokens", "accepted_tokens", "emitted_tokens", "verifying_sequences", "off_steps", "steps")


def requests_of(workload: str) -> list[dict[str, Any]]:
    """The generate() options of each prompt of a workload."""
    if workload == "edit":
        return [{"messages": [{"role": "user", "content": t}]} for t in spec_workloads.edit_prompts()]
    if workload == "json":
        return [
            {"messages": [{"role": "user", "content": t}], "json_schema": s} for t, s in spec_workloads.json_prompts()
        ]
    return [{"messages": [{"role": "user", "content": q}]} for q in spec_workloads.QUESTIONS]


class Window:
    def __init__(self, window_s: float, warmup_s: float) -> None:
        self.counted_from = time.monotonic() + warmup_s
        self.end = self.counted_from + window_s
        self.tokens = 0
        self.decode_rates: list[float] = []

    def arrived(self, n: int) -> None:
        if self.counted_from <= time.monotonic() < self.end:
            self.tokens += n


async def client(c: int, window: Window, address: str, prompts: list[dict[str, Any]], max_new: int) -> None:
    async with AsyncClient(address, timeout=600) as grpc:
        k = 0
        while time.monotonic() < window.end:
            options_ = prompts[(c * 7 + k) % len(prompts)]
            k += 1
            first = last = None
            tokens = 0
            async for response in grpc.generate(**options_, max_new_tokens=max_new, return_token_ids=True):
                n = len(response.token_ids)
                if n:
                    now = time.monotonic()
                    first = now if first is None else first
                    last = now
                    tokens += n
                    window.arrived(n)
            if first is not None and last is not None and last > first and first >= window.counted_from:
                window.decode_rates.append((tokens - 1) / (last - first))


def scrape(port: int) -> dict[str, float]:
    """The speculation counters (and the drafts-chosen family, by k) from a server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llmserve_spec_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.removeprefix("llmserve_spec_").removesuffix("_total")] = float(value)
    return out


def spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {name: after.get(f"{name}", 0.0) - before.get(f"{name}", 0.0) for name in SPEC_COUNTERS}
    chosen: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith("drafts_chosen_total{k=") or key.startswith("drafts_chosen{k="):
            k = key.split('"')[1]
            chosen[k] = value - before.get(key, 0.0)
    d["k_chosen"] = {k: v for k, v in sorted(chosen.items(), key=lambda kv: int(kv[0])) if v}
    return d


async def run_window(address: str, prompts: list[dict[str, Any]], clients: int, args: argparse.Namespace) -> Window:
    """One window; at its end the requests still running are cancelled (the server aborts them), so that no
    window's tail runs into the next."""
    window = Window(args.window_s, args.warmup_s)
    tasks = [asyncio.create_task(client(c, window, address, prompts, args.max_new_tokens)) for c in range(clients)]
    await asyncio.sleep(max(0.0, window.end - time.monotonic()))
    for task in tasks:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
            raise result
    await asyncio.sleep(0.5)  # the aborts reach the engine before the next window starts
    return window


def measure(servers: dict[str, tuple[str, int]], args: argparse.Namespace) -> dict[str, Any]:
    cells = []
    for workload in args.workloads.split(","):
        prompts = requests_of(workload)
        for clients in [int(c) for c in args.clients.split(",")]:
            cell: dict[str, Any] = {"workload": workload, "clients": clients, "windows": []}
            for w in range(args.windows):
                order = ("off", "on") if w % 2 == 0 else ("on", "off")
                for system in order:
                    address, metrics_port = servers[system]
                    before = scrape(servers["on"][1])
                    window = asyncio.run(run_window(address, prompts, clients, args))
                    after = scrape(servers["on"][1])
                    cell["windows"].append(
                        {
                            "system": system,
                            "tokens_per_s": window.tokens / args.window_s,
                            "per_stream_tokens_per_s": window.tokens / args.window_s / clients,
                            "decode_rate_median": statistics.median(window.decode_rates)
                            if window.decode_rates
                            else None,
                            "requests": len(window.decode_rates),
                            "spec": spec_delta(before, after) if system == "on" else None,
                        }
                    )
            summarise(cell)
            print(f"{workload} x{clients}: ratio {cell['ratio']}, acceptance {cell['acceptance_rate']}", flush=True)
            cells.append(cell)
    return {
        "method": args.method,
        "window_s": args.window_s,
        "warmup_s": args.warmup_s,
        "max_new_tokens": args.max_new_tokens,
        "cells": cells,
    }


def summarise(cell: dict[str, Any]) -> None:
    """Median tokens/s per system, the ratio of medians, and the speculating windows' draft counts summed."""
    by = {s: [w["tokens_per_s"] for w in cell["windows"] if w["system"] == s] for s in ("off", "on")}
    cell["tokens_per_s"] = {s: statistics.median(v) for s, v in by.items()}
    cell["ratio"] = cell["tokens_per_s"]["on"] / cell["tokens_per_s"]["off"] if cell["tokens_per_s"]["off"] else None
    pairs = [on / off for off, on in zip(by["off"], by["on"], strict=True) if off]
    cell["ratio_per_pair"] = pairs
    rates = {
        s: [w["decode_rate_median"] for w in cell["windows"] if w["system"] == s and w["decode_rate_median"]]
        for s in ("off", "on")
    }
    cell["decode_rate"] = {s: statistics.median(v) if v else None for s, v in rates.items()}
    specs = [w["spec"] for w in cell["windows"] if w["spec"]]
    total = {name: sum(s[name] for s in specs) for name in SPEC_COUNTERS}
    chosen: dict[str, float] = {}
    for s in specs:
        for k, v in s["k_chosen"].items():
            chosen[k] = chosen.get(k, 0) + v
    cell["spec"] = total | {"k_chosen": chosen}
    proposed = total["proposed_tokens"]
    cell["acceptance_rate"] = round(total["accepted_tokens"] / proposed, 3) if proposed else None
    decoding = total["steps"] + total["off_steps"]
    cell["off_share"] = round(total["off_steps"] / decoding, 3) if decoding else None
    verifying = total["verifying_sequences"]
    cell["mean_accepted"] = round(total["accepted_tokens"] / verifying, 2) if verifying else None


def main(argv: list[str]) -> int:
    p = options.parser("speculative", __doc__)
    p.add_argument("--method", default="suffix", choices=["suffix", "ngram"], help="what the speculating server runs")
    p.add_argument("--windows", type=int, default=2, help="windows per system per cell (alternated)")
    p.add_argument("--window-s", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--clients", default="1,4,32")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    if args.quick:
        args.windows, args.window_s, args.warmup_s, args.clients, args.max_new_tokens = 1, 3.0, 0.5, "1,4", 16
    run = writer.Run(options.command("speculative", argv))
    env = dict(child_env(), LLMSERVE_HISTORY_STORE="memory")
    procs, servers = [], {}
    try:
        for system, flag in (("off", "off"), ("on", args.method)):
            port, metrics_port = free_port(), free_port()
            address = f"127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "llmserve", "--address", address, "--log-level", "WARNING"]
            cmd += ["--metrics-port", str(metrics_port), "--speculative", flag]
            cmd += ["--device", args.device, "--dtype", args.dtype] + (["--model", args.model] if args.model else [])
            procs.append(subprocess.Popen(cmd, env=env))
            servers[system] = (address, metrics_port)
            asyncio.run(_wait_serving(address))  # one at a time: the second calibrates on an idle machine
        figures = measure(servers, args)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    run.model = {"model": args.model or "SmolLM2-135M-Instruct", "dtype": args.dtype, "device": args.device}
    writer.publish(run, args.out_dir, options.result_name(args, "speculative"), TITLE, figures, section)
    return 0


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    lines = [
        f"Two `python -m llmserve` servers (engine process each, the default model, float32): `--speculative off` and "
        f"`--speculative {result['method']}`; closed-loop gRPC clients, greedy, up to {result['max_new_tokens']} new "
        f"tokens; windows of {result['window_s']:g} s (after {result['warmup_s']:g} s unmeasured), alternated.",
        "",
    ]
    rows = []
    for cell in result["cells"]:
        tps, dec = cell["tokens_per_s"], cell["decode_rate"]
        pairs = ", ".join(f"{r:.2f}" for r in cell["ratio_per_pair"])
        chosen = " ".join(f"{k}:{int(v)}" for k, v in cell["spec"]["k_chosen"].items()) or "-"
        rows.append(
            [
                cell["workload"],
                cell["clients"],
                f"{tps['off']:.1f}",
                f"{tps['on']:.1f}",
                f"**{cell['ratio']:.2f}x** ({pairs})" if cell["ratio"] else "-",
                f"{writer.num(dec['off'], 1)} / {writer.num(dec['on'], 1)}",
                writer.num(cell["acceptance_rate"], 3),
                writer.num(cell["mean_accepted"], 2),
                chosen,
                writer.pct(cell["off_share"]) if cell["off_share"] is not None else "-",
            ]
        )
    header = [
        "workload",
        "clients",
        "off tok/s",
        "on tok/s",
        "ratio (per pair)",
        "decode tok/s per request off / on",
        "acceptance",
        "accepted per verify",
        "drafts chosen (k:count)",
        "steps left off",
    ]
    return lines + writer.table(header, rows)
