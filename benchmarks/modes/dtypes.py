"""float32 vs bfloat16 vs int8 on the CPU (issue 35), with llama.cpp's `llama-server` beside in its own formats.

Each llmserve dtype is `python -m llmserve --dtype D` as `make run` starts it (default flags, the engine process
included); each llama.cpp format is `llama-server` over one GGUF file (benchmarks/systems/llama_cpp.py). All
servers start first and stay up; then, at each client count, every system gets one window per round, the order
reversed every other round (A B C, C B A, ...), so that the machine's drift falls on all alike. Every system
gets the same token prompts in the same order within a round (the ladder's workload: chat prompts of 32-1,024
tokens, 128 new tokens, greedy, EOS ignored). Per system and client count: output tokens/s, TTFT P50/P99, peak
resident memory (server and engine process), and each window's share of its dtype's roofline (the floor of the
work it served at the peaks measured for that dtype: benchmarks/roofline.py).

    python benchmarks/run.py --mode dtypes [--clients 1,4,32] [--rounds 2] [--window-s 40] [--warmup-s 10]
        [--dtypes float32,bfloat16,int8] [--llama-server PATH] [--gguf FORMAT=FILE ...] [--quick]

llama.cpp is found by --llama-server or $LLAMA_SERVER and its GGUF files by --gguf (none: llama.cpp is skipped,
and the page says so). Writes benchmarks/results/<date>-cpu-dtypes.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import analysis, options, writer
from benchmarks import roofline as roofline_mod
from benchmarks.alternation import alternate, point
from benchmarks.metrics import summarize
from benchmarks.systems.base import System
from benchmarks.systems.grpc_e2e import GrpcSystem
from benchmarks.systems.llama_cpp import LlamaCppSystem, find_binary
from benchmarks.workload import PromptMaker, WorkloadSpec
from llmserve import cpu_features
from llmserve.engine.config import EngineConfig
from llmserve.models.loader import load_model

TITLE = "float32 vs bfloat16 vs int8 on the CPU, llama.cpp beside (issue 35)"
# Bytes per weight and per cached K/V value of each llmserve dtype, and the peak its kernels are held to.
LLMSERVE = {"float32": (4, 4, "float32"), "bfloat16": (2, 2, "bfloat16"), "int8": (1, 2, "int8")}
# llama.cpp's formats: bytes per weight (Q8_0: 34 bytes per 32; Q4_1: 20 per 32), its f16 cache, the nearest peak.
LLAMA_CPP = {"F32": (4, 2, "float32"), "BF16": (2, 2, "bfloat16"), "Q8_0": (34 / 32, 2, "int8"),
             "Q4_1": (20 / 32, 2, "int8")}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = options.parser("dtypes", __doc__)
    p.add_argument("--dtypes", default="float32,bfloat16,int8", help="llmserve's dtypes, comma-separated")
    p.add_argument("--clients", default="1,4,32", help="client counts, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="windows per system and client count (alternated)")
    p.add_argument("--window-s", type=float, default=40.0)
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (default: $LLAMA_SERVER)")
    p.add_argument("--gguf", nargs="*", default=[], metavar="FORMAT=FILE", help="GGUF files, e.g. Q8_0=model.gguf")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.window_s, args.warmup_s = "1", 1, 2.0, 0.5
    return args


def systems(args: argparse.Namespace, work: Path, slots: int, notes: list[str]) -> dict[str, tuple[System, tuple]]:
    """Every system by name, with its (weight bytes, KV bytes, peak dtype)."""
    out: dict[str, tuple[System, tuple]] = {}
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        refused = cpu_features.refusal(dtype, cpu_features.cpu_level())
        if refused is not None:  # the server would refuse to start: say why instead of measuring nothing
            notes.append(f"llmserve {dtype} skipped: {refused}")
            continue
        server = GrpcSystem(args.model, torch.device("cpu"), dtype, EngineConfig(), work / f"llmserve-{dtype}.log")
        server.name = f"llmserve {dtype}"
        out[server.name] = (server, LLMSERVE[dtype])
    binary = find_binary(args.llama_server)
    if binary is None:
        notes.append("llama.cpp skipped: no llama-server (pass --llama-server PATH or set $LLAMA_SERVER).")
        return out
    if not args.gguf:
        notes.append("llama.cpp skipped: no GGUF file given (--gguf FORMAT=FILE).")
    for item in args.gguf:
        fmt, _, path = item.partition("=")
        context = 1024 + 128 + 64 if not args.quick else 512
        out[f"llama.cpp {fmt}"] = (
            LlamaCppSystem(binary, Path(path), fmt, slots, context, work / f"llama-{fmt}.log"),
            LLAMA_CPP.get(fmt, (2, 2, "bfloat16")),
        )
    return out


async def measure(args: argparse.Namespace, run: writer.Run) -> dict[str, Any]:
    clients = [int(c) for c in args.clients.split(",")]
    spec = WorkloadSpec(max_prompt=128, max_new_tokens=8) if args.quick else WorkloadSpec()
    loaded = load_model(args.model, device="cpu", dtype="float32")  # the tokenizer and the config only
    run.measured_on(loaded)
    run.model["dtype"] = args.dtypes.replace(",", ", ")
    maker = PromptMaker(spec, loaded.tokenizer, loaded.vocab_size)
    prompt_lengths = [len(maker.request(k).prompt_ids) for k in range(1000)]
    config = loaded.model.config
    del loaded
    peaks = {d: roofline_mod.measure_peak(torch.device("cpu"), _peak_dtype(d), quick=args.quick) for d in LLMSERVE}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="llmserve-dtypes-") as tmp:
        chosen = systems(args, Path(tmp), max(clients), notes)
        try:
            await asyncio.gather(*(system.start() for system, _ in chosen.values()))
            windows = await alternate(chosen, clients, args, maker)
        finally:  # a system that never started has nothing to stop
            for system, _ in chosen.values():
                await system.stop()
    for d in LLMSERVE if not args.quick else ():  # again at the end, the best kept: load only ever lowers a peak
        again = roofline_mod.measure_peak(torch.device("cpu"), _peak_dtype(d))
        peaks[d] = roofline_mod.best_of(peaks[d], again)
    points: dict[str, dict[str, Any]] = {}
    for name, (_, (weight_bytes, kv_bytes, peak)) in chosen.items():
        points[name] = {}
        for c in clients:
            roof = roofline_mod.roofline(
                config, peaks[peak], weight_bytes, c, prompt_lengths, spec.max_new_tokens, kv_bytes
            )
            points[name][str(c)] = summary(windows[name][c], roof)
    return {
        "clients": clients,
        "rounds": args.rounds,
        "window_s": args.window_s,
        "warmup_s": args.warmup_s,
        "workload": {"min_prompt": spec.min_prompt, "max_prompt": spec.max_prompt, "new_tokens": spec.max_new_tokens},
        "cpu": os.cpu_count(),
        "peaks": {
            d: {"matmul_ops_per_s": p.matmul_flops_per_s, "read_bytes_per_s": p.read_bytes_per_s}
            for d, p in peaks.items()
        },
        "systems": {name: {"command": s.command, "bytes": list(b)} for name, (s, b) in chosen.items()},
        "points": points,
        "notes": notes,
    }


def _peak_dtype(dtype: str) -> torch.dtype | str:
    return roofline_mod.INT8 if dtype == "int8" else getattr(torch, dtype)


def summary(measurements: list[Any], roof: roofline_mod.Roofline) -> dict[str, Any]:
    """A system at one client count: alternation.point's figures and the median roofline share."""
    windows = [summarize("", m).windows[0] for m in measurements]
    shares = [s for s in (analysis.floor_share(roof, w) for w in windows) if s is not None]
    return point(measurements) | {"roofline_share": statistics.median(shares) if shares else None}


def ratios(data: dict[str, Any]) -> list[list[object]]:
    """The issue's comparisons, where both sides were measured."""
    points = data["points"]

    def rate(name: str, c: int) -> float | None:
        return points.get(name, {}).get(str(c), {}).get("median_output_tokens_per_s")

    rows: list[list[object]] = []
    for c in data["clients"]:
        f32, bf16 = rate("llmserve float32", c), rate("llmserve bfloat16", c)
        if f32 and bf16:
            rows.append([f"bfloat16 / float32, {c} clients", writer.times(bf16 / f32)])
        ours = {n: rate(n, c) for n in points if n.startswith("llmserve") and rate(n, c)}
        theirs = {n: rate(n, c) for n in points if n.startswith("llama.cpp") and rate(n, c)}
        if ours and theirs:
            best_ours = max(ours, key=lambda n: ours[n] or 0)
            best_theirs = max(theirs, key=lambda n: theirs[n] or 0)
            rows.append([f"{best_ours} / {best_theirs} (each side's best), {c} clients",
                         writer.times((ours[best_ours] or 0) / (theirs[best_theirs] or 1))])  # fmt: skip
            if "llama.cpp Q8_0" in theirs:
                rows.append([f"{best_ours} / llama.cpp Q8_0, {c} clients",
                             writer.times((ours[best_ours] or 0) / (theirs["llama.cpp Q8_0"] or 1))])  # fmt: skip
    return rows


def section(data: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    w = data["workload"]
    lines = [
        f"{data['rounds']} window(s) of {data['window_s']:g} s per system and client count (after "
        f"{data['warmup_s']:g} s of warm-up each), systems alternated; chat prompts of "
        f"{w['min_prompt']}-{w['max_prompt']} tokens, "
        f"{w['new_tokens']} new tokens, greedy, EOS ignored; {data['cpu']} CPU threads. Figures are medians over the "
        "windows; the per-window throughputs are listed. Memory: peak resident set of the server and its engine "
        "process (llama.cpp: its one process).",
        "",
    ]
    rows = []
    for name, by_clients in data["points"].items():
        for c, p in by_clients.items():
            rows.append([name, c, writer.num(p["median_output_tokens_per_s"], 1),
                         " / ".join(f"{x:.1f}" for x in p["output_tokens_per_s"]),
                         writer.seconds(p["ttft_p50_s"]), writer.seconds(p["ttft_p99_s"]),
                         writer.mib(p["peak_memory_bytes"]), writer.pct(p["roofline_share"]),
                         p["errors"]])  # fmt: skip
    lines += writer.table(
        ["system", "clients", "output tok/s", "per window", "TTFT P50", "TTFT P99", "memory", "of roofline", "errors"],
        rows,
    )
    if comparisons := ratios(data):
        lines += ["", *writer.table(["comparison", "ratio"], comparisons)]
    peaks = data["peaks"]
    lines += [
        "",
        "Peaks measured in this run (each dtype's roofline; llama.cpp's formats are held to the nearest):",
        "",
    ]
    lines += [f"- {d}: {p['matmul_ops_per_s'] / 1e9:.0f} G{'OP' if d == 'int8' else 'FLOP'}/s, "
              f"{p['read_bytes_per_s'] / 1e9:.1f} GB/s read" for d, p in peaks.items()]  # fmt: skip
    lines += ["", "Commands:", ""] + [f"- {n}: `{' '.join(s['command'])}`" for n, s in data["systems"].items()]
    lines += [f"- {note}" for note in data["notes"]]
    return lines


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    run = writer.Run(options.command("dtypes", argv))
    figures = asyncio.run(measure(args, run))
    writer.publish(run, args.out_dir, options.result_name(args, "dtypes"), TITLE, figures, section)
    return 1 if any(p["errors"] for by in figures["points"].values() for p in by.values()) else 0
