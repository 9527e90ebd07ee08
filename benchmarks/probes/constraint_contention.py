"""Probe: does filling 32 rows' bitmasks slow the forward that follows (llguidance's threads against torch's)?

Times five [32, 576] x [576, 49152] matmuls (a stand-in for a forward's LM head) alone, after a parallel bitmask
fill and after a serial one, alternated for 25 rounds. Run:

    PYTHONPATH=server:client python benchmarks/probes/constraint_contention.py
"""

from __future__ import annotations

from llmserve.process import configure_process

configure_process()  # as the server does, before torch

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import llguidance  # noqa: E402
import llguidance.torch as llt  # noqa: E402
import torch  # noqa: E402
from constraint_libraries import DOCUMENT, SCHEMAS, tokenizer  # noqa: E402

from llmserve.engine.constraints import ConstraintCompiler, Vocabulary  # noqa: E402
from llmserve.engine.request import ConstraintKind, ConstraintSpec  # noqa: E402

tok = tokenizer()
c = ConstraintCompiler(Vocabulary(tok, 49152, (2,)))
comp = c.submit(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"]))).result()
ids = tok.encode(DOCUMENT, add_special_tokens=False)
states = []
for i in range(32):
    s = comp.start()
    for t in ids[: i % (len(ids) - 2)]:
        s.accept(t)
    states.append(s)
ex = llguidance.LLExecutor(num_threads=2)
bm = torch.full((32, 1536), -1, dtype=torch.int32)
a = torch.randn(32, 576)
w = torch.randn(576, 49152)


def forward():
    t = time.perf_counter()
    for _ in range(5):
        a @ w
    return (time.perf_counter() - t) * 1e3


res = {"none": [], "par": [], "serial": []}
for _ in range(25):
    res["none"].append(forward())
    llt.fill_next_token_bitmask_par(ex, [(s.matcher, i) for i, s in enumerate(states)], bm)
    res["par"].append(forward())
    for i, s in enumerate(states):
        llt.fill_next_token_bitmask(s.matcher, bm, i)
    res["serial"].append(forward())
print({k: round(statistics.median(v), 2) for k, v in res.items()})
