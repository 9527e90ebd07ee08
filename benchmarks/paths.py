"""Where the code lives, so that the benchmark runs from a bare checkout (no `pip install -e .`), as on a
lent GPU machine: the repository root (for `benchmarks`), `server/` (llmserve) and `client/`
(llmserve_client), for this process and for every process it starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_ROOTS = (ROOT, ROOT / "server", ROOT / "client")


def make_importable() -> None:
    """Put the import roots at the front of sys.path (once)."""
    for path in reversed(IMPORT_ROOTS):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def child_env() -> dict[str, str]:
    """The environment for a subprocess: ours, offline, with the import roots on PYTHONPATH."""
    paths = [str(p) for p in IMPORT_ROOTS]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(paths))
