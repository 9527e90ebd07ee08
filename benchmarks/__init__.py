"""The benchmark ladder for llmserve: see benchmarks/run.py."""

import sys
from pathlib import Path

# From a bare checkout llmserve is not installed, so its folder goes on the path first (benchmarks/paths.py
# adds the rest).
_SERVER = str(Path(__file__).resolve().parents[1] / "server")
if _SERVER not in sys.path:
    sys.path.insert(0, _SERVER)

from llmserve.process import configure_process  # noqa: E402

# The benchmark owns its processes: every system runs under the server's OpenMP settings, made here before any
# benchmark process loads torch (and inherited by the processes it starts).
configure_process()
