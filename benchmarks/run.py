"""`make bench`: the benchmark ladder (naive → dynamic batching → continuous batching) in one run.

    python benchmarks/run.py                 # full run, ~15 min on the 2-core CPU machine
    python benchmarks/run.py --quick         # smoke run, under a minute
    python benchmarks/run.py --sessions      # also the session-reuse benchmark (issue 4)
    python benchmarks/run.py --n-completions # only n = 4 vs four calls (benchmarks/n_completions.py, issue 22)
    python benchmarks/run.py --structured    # only a JSON schema vs none, 32 clients (benchmarks/structured.py)
    python benchmarks/run.py --gateway       # only smg's OpenAI HTTP vs llmserve's gRPC (benchmarks/gateway.py)
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
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.paths import ROOT, child_env, make_importable  # noqa: E402

make_importable()

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks import analysis, report, runner  # noqa: E402
from benchmarks import roofline as roofline_mod  # noqa: E402
from benchmarks.roofline import measure_peak  # noqa: E402
from benchmarks.settings import (  # noqa: E402
    GPU_PLAN,
    GRPC_SYSTEMS,
    QUICK_PLAN,
    QUICK_WORKLOAD,
    SYSTEMS,
    TINY_PLAN,
    TINY_WORKLOAD,
    BenchSettings,
)
from benchmarks.workload import PromptMaker  # noqa: E402
from llmserve.models import LoadedModel  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: short prompts, few tokens, short windows")
    p.add_argument(
        "--plan",
        choices=("full", "gpu", "quick", "tiny"),
        default=None,
        help="default: gpu on CUDA, else full; quick: as --quick; tiny: for tests",
    )
    p.add_argument("--model", default=None, help="model spec for llmserve.models.load_model; unset: the default")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--sweep-grpc",
        action="store_true",
        help="sweep the gRPC system over concurrency too (the full CPU plan measures it at the main point only)",
    )
    p.add_argument("--sessions", action="store_true", help="also run the session-reuse benchmark (issue 4)")
    p.add_argument(
        "--n-completions",
        action="store_true",
        help="instead of the ladder: n = 4 completions vs four calls on a ~1,000-token prompt (with --quick: smoke)",
    )
    p.add_argument(
        "--structured",
        action="store_true",
        help="instead of the ladder: 32 clients with a JSON schema vs unconstrained, windows alternated (~5 min)",
    )
    p.add_argument(
        "--gateway",
        action="store_true",
        help="instead of the ladder: 32 clients through the smg gateway vs on llmserve's gRPC, alternated (~6 min)",
    )
    p.add_argument(
        "--isolation",
        choices=("process", "inline"),
        default=None,
        help="one process per system (default) or all in this process (default with --quick)",
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where results go")
    p.add_argument("--name", default=None, help="results file stem; default <date>-<device>[-<model>][-quick]")
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


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def result_name(args: argparse.Namespace, settings: BenchSettings) -> str:
    if args.name:
        return args.name
    device = "cpu" if settings.device == "cpu" else slug(torch.cuda.get_device_name(torch.device(settings.device)))
    parts = [datetime.date.today().isoformat(), device]
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
            from benchmarks import sessions as session_bench

            sessions_json, sessions_md = session_bench.run_isolated(settings, work, quick=quick)
    return runs, sessions_json, sessions_md


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    args.quick = args.quick or args.plan in ("quick", "tiny")
    if args.n_completions:  # its own process: it sets up the process (threads) before torch loads
        cmd = [sys.executable, "-m", "benchmarks.n_completions", *(["--quick"] if args.quick else [])]
        return subprocess.run(cmd, cwd=ROOT, env=child_env()).returncode
    if args.structured:  # likewise (no quick variant: its results file has one name per day)
        return subprocess.run([sys.executable, "-m", "benchmarks.structured"], cwd=ROOT, env=child_env()).returncode
    if args.gateway:  # likewise: the server and smg run as processes of their own
        return subprocess.run([sys.executable, "-m", "benchmarks.gateway"], cwd=ROOT, env=child_env()).returncode
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
        command="python benchmarks/run.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
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


if __name__ == "__main__":
    sys.exit(main())
