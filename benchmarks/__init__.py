"""The benchmark ladder for llmserve: see benchmarks/run.py."""

import os

# Every system must run under the same OpenMP wait policy, and the llmserve server defaults to PASSIVE (see
# llmserve/__init__.py): set it here, before any benchmark process loads torch, for all of them alike.
# An explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
