"""Speculative decoding's gain (issue 33): the server `make run` starts, with `--speculative off`, `ngram` and
`suffix`, on three workloads at 1, 4 and 32 clients.

Three servers (`python -m llmserve`, each with its engine process, the default model) run side by side; only one is
sent requests at a time. For each workload and client count, windows alternate between them (off ngram suffix,
suffix ngram off, ...) so that the machine's drift hits all alike. No prompt is sent twice to a server in a run
(suffix decoding's cache of past answers could otherwise draft a repeated request's answer whole): the windows of
one round (one window per server) each take the workload's prompts from the same unseen point on, in order, and the
next round starts past the furthest any of them got; the workloads have hundreds of distinct prompts each.

Clients are closed-loop over gRPC (llmserve_client, chat messages, the server's chat template), greedy, answers
ending as they end (EOS, or the schema complete) or at --max-new-tokens. The workloads (benchmarks/spec_workloads.py):
(a) `edit`, rewriting, summarising or commenting a given text (high overlap with the prompt); (b) `json`,
JSON-schema answers (the schema sent as the request's constraint); (c) `chat`, open questions.

Per window: the output tokens that arrived inside it over its length (all clients: tokens/s; per client: per-stream
tokens/s) and each finished request's decode rate (tokens after the first over the time from the first to the last).
From each speculating server's metrics (scraped before and after its windows): drafts proposed and accepted, tokens
emitted by verifying sequences, sequence-steps by drafts chosen, and the decoding steps the load rule left off.

    python benchmarks/run.py --mode speculative [--windows 2] [--window-s 15] [--clients 1,4,32]
        [--methods ngram,suffix] [--quick]

Writes benchmarks/results/<date>-<device>-speculative.{md,json}. --model, --device and --dtype go to the servers (the
model needs a tokenizer: the prompts are chat messages).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import options, spec_workloads, writer
from benchmarks.serve import Server
from benchmarks.window import Window
from llmserve_client import AsyncClient

TITLE = "Speculative decoding: off vs ngram vs suffix, three workloads, 1-32 clients over gRPC (issue 33)"
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
    return [{"messages": [{"role": "user", "content": q}]} for q in spec_workloads.chat_prompts()]


class Feed:
    """A workload's prompts, each handed out once per server: `round()` gives every server of a round the same
    unseen stretch (from the same point, in order), and the next round starts past the furthest any server got."""

    def __init__(self, workload: str, prompts: list[dict[str, Any]]) -> None:
        self.workload = workload
        self.prompts = prompts
        self.start = 0  # the first prompt no server has been sent
        self.taken: list[int] = []  # how far each window of this round got

    def window(self) -> Callable[[], dict[str, Any]]:
        """The next prompt of one window: from the round's start, each prompt once."""
        self.taken.append(self.start)
        slot = len(self.taken) - 1

        def take() -> dict[str, Any]:
            i = self.taken[slot]
            if i >= len(self.prompts):
                raise RuntimeError(f"{self.workload}: all {len(self.prompts)} prompts used (a repeat would follow)")
            self.taken[slot] = i + 1
            return self.prompts[i]

        return take

    def next_round(self) -> None:
        self.start = max(self.taken, default=self.start)
        self.taken = []


async def client(window: Window, address: str, take: Callable[[], dict[str, Any]], max_new: int) -> None:
    async with AsyncClient(address, timeout=600) as grpc:
        while not window.over:
            options_ = take()
            began, arrivals, finished = window.begin(), [], False
            try:
                async for response in grpc.generate(**options_, max_new_tokens=max_new, return_token_ids=True):
                    if response.token_ids:
                        arrivals.append((time.monotonic(), len(response.token_ids)))
                finished = True
            finally:  # cut off at the window's end: its tokens so far count, its decode rate does not
                window.done(began, arrivals, finished)


def scrape(metrics_url: str) -> dict[str, float]:
    """The speculation counters (and the drafts-chosen family, by k) from a server's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llmserve_spec_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.removeprefix("llmserve_spec_").removesuffix("_total")] = float(value)
    return out


def spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d: dict[str, Any] = {name: after.get(f"{name}", 0.0) - before.get(f"{name}", 0.0) for name in SPEC_COUNTERS}
    chosen: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith("drafts_chosen_total{k=") or key.startswith("drafts_chosen{k="):
            k = key.split('"')[1]
            chosen[k] = value - before.get(key, 0.0)
    d["k_chosen"] = {k: v for k, v in sorted(chosen.items(), key=lambda kv: int(kv[0])) if v}
    return d


async def run_window(
    address: str, take: Callable[[], dict[str, Any]], clients: int, args: argparse.Namespace
) -> Window:
    """One window; at its end the requests still running are cancelled (the server aborts them), so that no
    window's tail runs into the next."""
    window = Window.starting_now(args.warmup_s, args.window_s)
    tasks = [asyncio.create_task(client(window, address, take, args.max_new_tokens)) for _ in range(clients)]
    await asyncio.sleep(max(0.0, window.end - time.monotonic()))
    for task in tasks:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
            raise result
    await asyncio.sleep(0.5)  # the aborts reach the engine before the next window starts
    return window


def measure(servers: dict[str, Server], args: argparse.Namespace, checkpoint: Path) -> dict[str, Any]:
    """Every cell (workload x clients), each written to `checkpoint` as it ends, so a cut-off run keeps them."""
    systems = list(servers)
    cells = []
    for workload in args.workloads.split(","):
        feed = Feed(workload, requests_of(workload))
        for clients in [int(c) for c in args.clients.split(",")]:
            cell: dict[str, Any] = {"workload": workload, "clients": clients, "windows": []}
            for w in range(args.windows):
                for system in systems if w % 2 == 0 else systems[::-1]:
                    server = servers[system]
                    before = scrape(server.metrics_url) if system != "off" else {}
                    prompt_from = feed.start
                    window = asyncio.run(run_window(server.address, feed.window(), clients, args))
                    after = scrape(server.metrics_url) if system != "off" else {}
                    cell["windows"].append(
                        {
                            "system": system,
                            "round": w,
                            "prompts": [prompt_from, feed.taken[-1]],
                            "tokens_per_s": window.tokens_per_s,
                            "per_stream_tokens_per_s": window.tokens_per_s / clients,
                            "decode_rate_median": statistics.median(window.decode_rates)
                            if window.decode_rates
                            else None,
                            "requests": len(window.decode_rates),
                            "spec": spec_delta(before, after) if system != "off" else None,
                        }
                    )
                feed.next_round()
            summarise(cell, systems)
            ratios = {m: cell["methods"][m]["ratio"] for m in systems[1:]}
            accepted = {m: cell["methods"][m]["acceptance_rate"] for m in systems[1:]}
            print(f"{workload} x{clients}: ratio {ratios}, acceptance {accepted}", flush=True)
            cells.append(cell)
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            checkpoint.write_text(json.dumps(cells, indent=1) + "\n")
    return {
        "systems": systems,
        "window_s": args.window_s,
        "warmup_s": args.warmup_s,
        "max_new_tokens": args.max_new_tokens,
        "prompts": {w: len(requests_of(w)) for w in args.workloads.split(",")},
        "cells": cells,
    }


def summarise(cell: dict[str, Any], systems: list[str]) -> None:
    """Median tokens/s per system; for each speculating one: the ratio of medians to off, the ratio in each round,
    its windows' draft counts summed, acceptance, accepted drafts per verifying sequence-step, share of decoding
    steps left off."""
    by = {s: [w["tokens_per_s"] for w in cell["windows"] if w["system"] == s] for s in systems}
    cell["tokens_per_s"] = {s: statistics.median(v) for s, v in by.items()}
    rates = {
        s: [w["decode_rate_median"] for w in cell["windows"] if w["system"] == s and w["decode_rate_median"]]
        for s in systems
    }
    cell["decode_rate"] = {s: statistics.median(v) if v else None for s, v in rates.items()}
    off = cell["tokens_per_s"]["off"]
    cell["methods"] = {}
    for method in systems[1:]:
        specs = [w["spec"] for w in cell["windows"] if w["system"] == method and w["spec"]]
        total = {name: sum(s[name] for s in specs) for name in SPEC_COUNTERS}
        chosen: dict[str, float] = {}
        for s in specs:
            for k, v in s["k_chosen"].items():
                chosen[k] = chosen.get(k, 0) + v
        proposed, verifying = total["proposed_tokens"], total["verifying_sequences"]
        decoding = total["steps"] + total["off_steps"]
        cell["methods"][method] = {
            "ratio": cell["tokens_per_s"][method] / off if off else None,
            "ratio_per_round": [b / a for a, b in zip(by["off"], by[method], strict=True) if a],
            "spec": total | {"k_chosen": chosen},
            "acceptance_rate": round(total["accepted_tokens"] / proposed, 3) if proposed else None,
            "mean_accepted": round(total["accepted_tokens"] / verifying, 2) if verifying else None,
            "off_share": round(total["off_steps"] / decoding, 3) if decoding else None,
        }


def main(argv: list[str]) -> int:
    p = options.parser("speculative", __doc__)
    p.add_argument("--methods", default="ngram,suffix", help="the speculating servers, beside one with it off")
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
    methods = [m for m in args.methods.split(",") if m]
    if not methods or not set(methods) <= {"ngram", "suffix"}:
        p.error("--methods: ngram, suffix or both")
    name = options.result_name(args, "speculative")
    checkpoint = args.out_dir / f"{name}.partial.json"
    servers: dict[str, Server] = {}
    try:
        for system in ["off", *methods]:
            servers[system] = server = Server(
                ["--speculative", system], model=args.model, device=args.device, dtype=args.dtype, metrics=True
            )
            server.start()
            asyncio.run(server.wait_serving())  # one at a time: each calibrates on an idle machine
            print(f"{system} serving after {time.perf_counter() - run.started:.0f} s", flush=True)
        figures = measure(servers, args, checkpoint)
    finally:
        for server in servers.values():
            server.stop()
    run.model = {"model": args.model or "SmolLM2-135M-Instruct", "dtype": args.dtype, "device": args.device}
    writer.publish(run, args.out_dir, name, TITLE, figures, section)
    checkpoint.unlink(missing_ok=True)
    return 0


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    methods = result["systems"][1:]
    prompts = ", ".join(f"{w} {n}" for w, n in result["prompts"].items())
    lines = [
        f"Servers `python -m llmserve` (engine process each, the default model, float32) with `--speculative "
        f"{'`, `'.join(result['systems'])}`; closed-loop gRPC clients, greedy, up to {result['max_new_tokens']} new "
        f"tokens; windows of {result['window_s']:g} s (after {result['warmup_s']:g} s unmeasured), alternated "
        f"({' '.join(result['systems'])}, then reversed). No prompt sent twice to a server (distinct prompts: "
        f"{prompts}). Ratio: median output tokens/s (all clients; per stream it is the same ratio) over off's.",
        "",
    ]
    rows = []
    for cell in result["cells"]:
        tps, dec = cell["tokens_per_s"], cell["decode_rate"]
        for method in methods:
            m = cell["methods"][method]
            rounds = ", ".join(f"{r:.2f}" for r in m["ratio_per_round"])
            by_k = sorted(m["spec"]["k_chosen"].items(), key=lambda kv: int(kv[0]))
            chosen = " ".join(f"{k}:{int(v)}" for k, v in by_k) or "-"
            rows.append(
                [
                    cell["workload"],
                    cell["clients"],
                    method,
                    f"{tps['off']:.1f}",
                    f"{tps[method]:.1f}",
                    f"{tps[method] / cell['clients']:.1f}",
                    f"**{m['ratio']:.2f}x** ({rounds})" if m["ratio"] else "-",
                    f"{writer.num(dec['off'], 1)} / {writer.num(dec[method], 1)}",
                    writer.num(m["acceptance_rate"], 3),
                    writer.num(m["mean_accepted"], 2),
                    chosen,
                    writer.pct(m["off_share"]) if m["off_share"] is not None else "-",
                ]
            )
    header = [
        "workload",
        "clients",
        "method",
        "off tok/s",
        "method tok/s",
        "per stream",
        "ratio (per round)",
        "decode tok/s per request off / method",
        "acceptance",
        "accepted per verify",
        "drafts chosen (k:count)",
        "steps left off",
    ]
    return lines + writer.table(header, rows)
