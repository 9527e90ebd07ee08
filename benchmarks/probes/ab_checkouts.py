"""Same-run A/B of checkouts: one system (default the in-process engine; `llmserve_grpc` for the server over gRPC,
started as `python -m llmserve`) at the full CPU plan's main point (32 clients, its windows), each checkout's own
code measured in a process of its own, the checkouts alternated round by round (A B, B A, ...) so that the
machine's drift falls on all alike.

    git worktree add /tmp/old <commit before a change>
    python benchmarks/run.py --mode ab /tmp/old . [--system llmserve_grpc] [--rounds 2] [--clients 1]

Each measurement runs `python -m benchmarks.runner SYSTEM SETTINGS OUT` in the checkout (a command every
checkout since the benchmark ladder has; the settings are this checkout's `BenchSettings` JSON), with that
checkout first on PYTHONPATH. Prints one JSON line per measurement and writes the windows' output tokens/s and
their medians per checkout.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import options, writer
from benchmarks.metrics import window_stats
from benchmarks.paths import child_env
from benchmarks.runner import run_from_json
from benchmarks.settings import QUICK_PLAN, QUICK_WORKLOAD, BenchSettings

TITLE = "Same-run A/B of checkouts"


def measure(root: Path, system: str, settings: BenchSettings, work: Path) -> dict[str, Any]:
    """One measurement of `system` with the code of the checkout at `root`: its windows' output tokens/s."""
    settings_path, out = work / "settings.json", work / f"{system}.json"
    settings_path.write_text(settings.to_json())
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.runner", system, str(settings_path), str(out)]
    proc = subprocess.run(cmd, cwd=root, env=child_env(root))
    if proc.returncode != 0 or not out.exists():
        return {"root": str(root), "system": system, "error": f"runner exited with {proc.returncode}", "windows": []}
    run = run_from_json(json.loads(out.read_text()))
    m = run.measurements[0] if run.measurements else None
    windows = [window_stats(m, i).output_tokens_per_s for i in range(len(m.window_starts))] if m else []
    return {"root": str(root), "system": system, "error": run.error, "windows": windows, "load": run.loadavg_before}


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    rows = [
        [i + 1, m["root"], ", ".join(f"{w:.1f}" for w in m["windows"]), m["error"] or ""]
        for i, m in enumerate(result["measurements"])
    ]
    clients = result.get("clients", 32)
    lines = [f"System `{result['system']}` at {clients} clients, checkouts alternated round by round.", ""]
    lines += writer.table(["#", "checkout", "output tok/s per window", "error"], rows) + [""]
    medians = [[root, writer.num(median, 1)] for root, median in result["median_window"].items()]
    return lines + writer.table(["checkout", "median window tok/s"], medians)


def main(argv: list[str]) -> int:
    p = options.parser("ab", __doc__)
    p.add_argument("roots", nargs="+", type=Path, help="the checkouts (one or more folders)")
    p.add_argument("--system", default="llmserve", help="a system of the ladder (llmserve, llmserve_grpc, ...)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over all checkouts, order reversed every other")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default: the plan's main point, 32)")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up before the windows (default: the plan's)")
    p.add_argument("--window-s", type=float, default=None, help="each window's length (default: the plan's)")
    args = p.parse_args(argv)
    run = writer.Run(options.command("ab", argv))
    roots = [root.resolve() for root in args.roots]
    settings = BenchSettings(model=args.model, device=args.device, dtype=args.dtype)
    settings = replace(settings, sweep_systems=())
    if args.quick:
        settings = replace(settings, plan=QUICK_PLAN, workload=QUICK_WORKLOAD)
    main = settings.plan.main
    if args.clients is not None and args.clients < 1:
        p.error("--clients must be at least 1")
    main = replace(
        main,
        concurrency=args.clients or main.concurrency,
        warmup_s=main.warmup_s if args.warmup_s is None else args.warmup_s,
        window_s=main.window_s if args.window_s is None else args.window_s,
    )
    settings = replace(settings, plan=replace(settings.plan, main=main))
    settings = settings.sized()
    measurements = []
    with tempfile.TemporaryDirectory(prefix="llmserve-ab-") as tmp:
        for r in range(args.rounds):
            for root in roots if r % 2 == 0 else roots[::-1]:
                measurements.append(measure(root, args.system, settings, Path(tmp)))
                print(json.dumps(measurements[-1]), flush=True)
    median: dict[str, float | None] = {}
    for root in roots:
        windows = [w for m in measurements if m["root"] == str(root) for w in m["windows"]]
        median[str(root)] = statistics.median(windows) if windows else None
    clients = settings.plan.main.concurrency
    figures = {"system": args.system, "clients": clients, "measurements": measurements, "median_window": median}
    writer.publish(run, args.out_dir, options.result_name(args, f"ab-{args.system}"), TITLE, figures, section)
    return 0 if all(not m["error"] for m in measurements) else 1
