"""Same-run A/B of two checkouts: one system (default the in-process engine; `llmserve_grpc` for the server over
gRPC, started as `python -m llmserve`) at the full CPU plan's main point (32 clients, its windows).

Run it once per checkout, alternating (A B A B), and compare the windows' output tokens/s:

    git worktree add /tmp/old <commit before a change>
    for root in /tmp/old . /tmp/old .; do .venv/bin/python benchmarks/probes/ab_checkouts.py "$root" [SYSTEM]; done

Each run imports the benchmark code and llmserve from the checkout it is given and prints one JSON line.
"""

import asyncio
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

root = Path(sys.argv[1]).resolve()
system = sys.argv[2] if len(sys.argv) > 2 else "llmserve"
sys.path[:0] = [str(root), str(root / "server"), str(root / "client")]
os.chdir(root)

import benchmarks  # noqa: E402,F401  (the checkout's process settings)
from benchmarks import runner  # noqa: E402
from benchmarks.metrics import window_stats  # noqa: E402
from benchmarks.settings import BenchSettings  # noqa: E402

settings = replace(BenchSettings(model=None, device="cpu", dtype="auto"), sweep_systems=()).sized()
loaded = runner.load(settings)
run = asyncio.run(runner.measure(system, loaded, settings, Path("/tmp")))
m = run.measurements[0]
windows = [window_stats(m, i).output_tokens_per_s for i in range(len(m.window_starts))]
out = {"root": str(root), "system": system, "error": run.error, "windows": windows, "load": run.loadavg_before}
print(json.dumps(out))
