"""Several benchmarks/run.py commands in one Python, one after another: gpu.sh's dry run, whose parts (seconds of
work each on tiny sizes) would otherwise each pay a start of torch, transformers and the engine (~7 s of CPU on the
2-core machine).

    python benchmarks/probes/run_parts.py 'NAME: RUN.PY ARGUMENTS' ...

The arguments are split as a shell splits them. Each part prints `== NAME` and `== NAME: exit RC after S s`, as
gpu.sh's own parts do; a part that raises exits 1, and the next part runs. Exits 1 when any part failed. The process
is set up as run.py sets up its own (import paths, process settings) before the first part loads torch.
"""

from __future__ import annotations

import shlex
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_part(name: str, argv: list[str]) -> int:
    """One run.py command in this process: its exit status (1 for an exception, argparse's for bad arguments)."""
    from benchmarks import run

    t0 = time.perf_counter()
    print(f"== {name} (in process)", flush=True)
    try:
        rc = run.main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        rc = 1
    print(f"== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


def main(parts: list[str]) -> int:
    """Run each 'NAME: ARGUMENTS' in turn; 0 when all exited 0."""
    commands = []
    for part in parts:
        name, sep, args = part.partition(":")
        if not sep or not name.strip():
            print(f"run_parts.py: {part!r} is not 'NAME: ARGUMENTS'", file=sys.stderr)
            return 2
        commands.append((name.strip(), shlex.split(args)))
    failed = [name for name, argv in commands if run_part(name, argv) != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    # As run.py's own start: the repository root instead of this folder, then server/ and client/; the process
    # settings before any part loads torch.
    sys.path[0] = str(ROOT)
    from benchmarks.paths import IMPORT_ROOTS

    sys.path[1:1] = [str(p) for p in IMPORT_ROOTS if str(p) not in sys.path]
    from llmserve.process_settings import configure_process

    configure_process()
    sys.exit(main(sys.argv[1:]))
