"""The one entry of the benchmarks: `python benchmarks/run.py [--mode NAME] [options]`.

Without --mode it runs the ladder (`make bench`); `--mode NAME --help` shows a mode's options; `--list` lists
the modes. Each run writes benchmarks/results/<name>.{md,json} (benchmarks/writer.py). How to add a mode:
benchmarks/modes/__init__.py.

    python benchmarks/run.py --quick                  # the ladder, a one-minute smoke run (make bench-quick)
    python benchmarks/run.py --mode kv-tiers --quick  # one mode, smoke-sized
"""

from __future__ import annotations

import gc
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def usage() -> str:
    from benchmarks.modes import DEFAULT, MODES

    rows = [f"  {m.name:14s} {m.summary}{' (probe)' if m.probe else ''}" for m in MODES.values()]
    return "\n".join([f"modes (default {DEFAULT}):", *rows])


def main(argv: list[str] | None = None) -> int:
    """Run the mode `--mode` names (default: the ladder) with the rest of `argv`."""
    from benchmarks.modes import DEFAULT, MODES

    args = list(sys.argv[1:] if argv is None else argv)
    if "--list" in args:
        print(usage())
        return 0
    name = DEFAULT
    for i, arg in enumerate(args):
        if arg == "--mode" or arg.startswith("--mode="):
            name = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            del args[i : i + (1 if "=" in arg else 2)]
            break
    if name == DEFAULT and ("-h" in args or "--help" in args):
        print(usage() + "\n\nThe ladder's options:")
    if name not in MODES:
        print(f"benchmarks/run.py: unknown mode {name!r}\n{usage()}", file=sys.stderr)
        return 2
    result: int = importlib.import_module(MODES[name].module).main(args)
    return result


if __name__ == "__main__":
    # From a bare checkout (a lent GPU machine has no `pip install -e .`): the repository root instead of this
    # folder, then server/ and client/; the process settings before any mode loads torch. Subprocesses get the
    # same through benchmarks.paths.child_env.
    sys.path[0] = str(ROOT)
    from benchmarks.paths import IMPORT_ROOTS

    sys.path[1:1] = [str(p) for p in IMPORT_ROOTS if str(p) not in sys.path]
    from llmserve.process_settings import configure_process

    configure_process()
    status = main()
    gc.freeze()  # done: the teardown need not collect torch's and the model's objects (~1.5 CPU-s, seconds of wall)
    sys.exit(status)
