"""The benchmark ladder for llmserve: see benchmarks/run.py."""

import sys
from pathlib import Path

# Every system must run under the same OpenMP wait settings: importing llmserve applies the server's default
# (see llmserve/__init__.py) before any benchmark process loads torch, for all of them alike. From a bare
# checkout llmserve is not installed, so its folder goes on the path first (benchmarks/paths.py adds the rest).
_SERVER = str(Path(__file__).resolve().parents[1] / "server")
if _SERVER not in sys.path:
    sys.path.insert(0, _SERVER)

import llmserve  # noqa: E402, F401
