"""Where the code lives, so that the benchmarks run from a bare checkout (no `pip install -e .`), as on a lent GPU
machine: the repository root (for `benchmarks`), `server/` (llmserve) and `client/` (llmserve_client).
benchmarks/run.py puts them on its own path; every process a benchmark starts gets them from `child_env`."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_ROOTS = (ROOT, ROOT / "server", ROOT / "client")


def child_env(root: Path = ROOT) -> dict[str, str]:
    """The environment for a subprocess running the code of the checkout at `root`: ours, with its import roots
    first on PYTHONPATH and the process settings `python -m llmserve` makes (offline, bounded oneDNN caches),
    which must be in place before the child loads torch."""
    from llmserve.process_settings import configure_process

    paths = [str(root), str(root / "server"), str(root / "client")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    configure_process(env)
    return env
