"""The benchmark ladder (naive → dynamic batching → continuous batching → llmserve in-process and over gRPC) in
one run: `make bench`, the default mode of benchmarks/run.py.

    python benchmarks/run.py                 # full run, ~15 min on the 2-core CPU machine
    python benchmarks/run.py --quick         # smoke run, under a minute
    python benchmarks/run.py --sessions      # also the sessions mode, its section in the same page (issue 4)
    python benchmarks/run.py --device cuda --model random:llama-1b   # GPU, bf16, random weights

Writes benchmarks/results/<date>-<device>[-<model>][-quick].{md,json} and PNG plots beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers

from benchmarks import analysis, options, report, runner
from benchmarks import roofline as roofline_mod
from benchmarks.paths import ROOT, child_env
from benchmarks.roofline import measure_peak
from benchmarks.settings import (
    GPU_PLAN,
    GRPC_SYSTEMS,
    QUICK_PLAN,
    QUICK_WORKLOAD,
    SYSTEMS,
    TINY_PLAN,
    TINY_WORKLOAD,
    BenchSettings,
)
from benchmarks.workload import PromptMaker
from benchmarks.writer import device_slug, slug
from llmserve.engine.types.model import LoadedModel


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = options.parser("ladder", __doc__)
    p.set_defaults(device="auto")
    p.add_argument(
        "--plan",
        choices=("full", "gpu", "quick", "tiny"),
        default=None,
        help="default: gpu on CUDA, else full; quick: as --quick; tiny: for tests",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--sweep-grpc",
        action="store_true",
        help="sweep the gRPC system over concurrency too (the full CPU plan measures it at the main point only)",
    )
    p.add_argument("--sessions", action="store_true", help="also the sessions mode (its own process), same page")
    p.add_argument(
        "--isolation",
        choices=("process", "inline"),
        default=None,
        help="one process per system (default) or all in this process (default with --quick)",
    )
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    s = BenchSettings(model=args.model, device=device, dtype=args.dtype)
    s = replace(s, workload=replace(s.workload, seed=args.seed))
    if args.plan == "tiny":
        s = replace(s, workload=replace(TINY_WORKLOAD, seed=args.seed), plan=TINY_PLAN, roofline_quick=True)
    elif args.quick:
        s = replace(s, workload=replace(QUICK_WORKLOAD, seed=args.seed), plan=QUICK_PLAN)
    elif args.plan == "gpu" or (args.plan is None and device.startswith("cuda")):
        s = replace(s, plan=GPU_PLAN)
    elif not args.sweep_grpc:
        # Their cost over in-process is a question for the main point; sweeping them would add ~4 minutes each.
        s = replace(s, sweep_systems=tuple(n for n in SYSTEMS if n not in GRPC_SYSTEMS))
    return s.sized()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or 'CPU'} ({os.cpu_count()} cores)"


def result_name(args: argparse.Namespace, settings: BenchSettings) -> str:
    if args.name:
        return args.name
    parts = [datetime.date.today().isoformat(), device_slug(settings.device)]
    if settings.model:
        parts.append(slug(Path(settings.model).name))
    if args.quick:
        parts.append("quick")
    return "-".join(parts)


def measure_isolated(name: str, settings: BenchSettings, work: Path) -> runner.SystemRun:
    """Run one system in a fresh process; its stderr passes through."""
    settings_path, out_path = work / "settings.json", work / f"{name}.json"
    settings_path.write_text(settings.to_json())
    cmd = [sys.executable, "-m", "benchmarks.runner", name, str(settings_path), str(out_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env())
    if proc.returncode != 0 or not out_path.exists():
        return runner.SystemRun(name, error=f"runner process exited with {proc.returncode}")
    return runner.run_from_json(json.loads(out_path.read_text()))


def machine_info(loaded: LoadedModel, isolation: str) -> dict:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": str(loaded.device),
        "device_name": device_name(loaded.device),
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "isolation": isolation,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }


def measure_all(
    names: list[str], loaded: LoadedModel, settings: BenchSettings, isolation: str, sessions: bool, quick: bool
) -> tuple[list[runner.SystemRun], dict | None, str]:
    """Every system, then the session benchmark when asked; one process each unless `isolation` is inline."""
    sessions_json, sessions_md = None, ""
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-") as tmp:
        work = Path(tmp)
        if isolation == "process":
            runs = [measure_isolated(n, settings, work) for n in names]
        else:
            runs = [asyncio.run(runner.measure(n, loaded, settings, work)) for n in names]
        if sessions:
            from benchmarks.modes import sessions as sessions_mode

            sessions_json, sessions_md = sessions_mode.run_isolated(settings, work, quick=quick)
    return runs, sessions_json, sessions_md


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.quick = args.quick or args.plan in ("quick", "tiny")
    settings = settings_from(args)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    if unknown := set(names) - set(SYSTEMS):
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    isolation = args.isolation or ("inline" if args.quick else "process")
    started = time.perf_counter()

    loaded = runner.load(settings)
    maker = PromptMaker(settings.workload, loaded.tokenizer, loaded.vocab_size)
    prompt_lengths = [len(maker.request(k).prompt_ids) for k in range(1000)]
    machine = machine_info(loaded, isolation)
    device, dtype, config = loaded.device, loaded.dtype, loaded.model.config
    peak = measure_peak(device, dtype, quick=settings.roofline_quick)
    if isolation == "process":  # the systems load their own copies
        del loaded
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        loaded = None
    runs, sessions_json, sessions_md = measure_all(names, loaded, settings, isolation, args.sessions, args.quick)

    # Measured again at the end and the best kept: other load on a shared machine only ever lowers peaks.
    peak = roofline_mod.best_of(peak, measure_peak(device, dtype, quick=settings.roofline_quick))
    main_c, new_tokens = settings.plan.main.concurrency, settings.workload.max_new_tokens
    roof = roofline_mod.roofline(config, peak, dtype.itemsize, main_c, prompt_lengths, new_tokens)
    points = {r.system: analysis.system_points(r, settings.plan) for r in runs if r.measurements}
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result = report.BenchResult(
        name=result_name(args, settings),
        command=options.command("ladder", argv),
        settings=settings,
        machine=machine,
        mean_prompt_tokens=sum(prompt_lengths) / len(prompt_lengths),
        roofline=roof,
        runs=runs,
        points=points,
        targets=analysis.targets(points, main_c, roof),
        wall_s=time.perf_counter() - started,
        sessions_json=sessions_json,
        sessions_markdown=sessions_md,
    )
    if args.quick:
        result.notes.append("Quick smoke run: short prompts, few tokens, short windows. Not a measurement to quote.")
    path = report.write(result, args.out_dir)
    print(
        f"roofline {peak.matmul_flops_per_s / 1e9:.1f} GFLOP/s, {peak.read_bytes_per_s / 1e9:.1f} GB/s; "
        f"wrote {path} ({result.wall_s:.0f} s)",
        file=sys.stderr,
    )
    return 1 if any(r.error for r in runs) else 0
