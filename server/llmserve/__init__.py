"""llmserve: a gRPC service streaming tokens from a continuous-batching LLM engine."""

import os

# OpenMP threads that spin while waiting for work collapse when anything else wants the cores (the
# event loop, a gRPC thread, a client on the same host): measured on 2 cores with one competing process,
# a 512-token step took 11.2 s spinning and 2.2 s passive. Must be set before torch loads libgomp;
# an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
