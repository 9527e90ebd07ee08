"""llmserve: a gRPC service streaming tokens from a continuous-batching LLM engine."""

import os

# How long idle OpenMP threads spin before they sleep. A model forward is hundreds of short parallel
# regions; threads that sleep at once (OMP_WAIT_POLICY=PASSIVE) pay a wake-up in each, threads that spin
# without end (ACTIVE, or long spins) collapse when anything else wants the cores. Measured on the 2-core
# machine, SmolLM2-135M decode step at 32 sequences, quiet / with one competing busy process: PASSIVE
# 222 / 236 ms, GOMP_SPINCOUNT=3000 139 / 285 ms, 30000 134 / 831 ms, 100000 151 / 1,429 ms. A short
# spin keeps most of the speed and little of the collapse. Must be set before torch loads libgomp; an
# explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins (PASSIVE suits a shared machine).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")
