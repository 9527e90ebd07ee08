"""Probe: what constraints add to one sampling step at 32 rows (SmolLM2's vocabulary, 49,152 ids).

Times `sample()` on [32, 49152] logits for 32 sampled rows: unconstrained, and each row constrained by the same JSON
schema at a different position of a valid document (the bitmask fill and the mask add included), alternated
round by round so that the machine's drift hits both alike. Also the fill alone. Run:

    PYTHONPATH=server:client python benchmarks/probes/constraint_step.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llmserve.process import configure_process

configure_process()  # as the server does, before torch: a short OpenMP spin (a long one starves the grammar threads)

import torch  # noqa: E402
from constraint_libraries import DOCUMENT, SCHEMAS, tokenizer  # noqa: E402

from llmserve.engine.constraints import ConstraintCompiler, Vocabulary  # noqa: E402
from llmserve.engine.generators import Generators  # noqa: E402
from llmserve.engine.masks import TokenMasks  # noqa: E402
from llmserve.engine.request import ConstraintKind, ConstraintSpec, SamplingParams  # noqa: E402
from llmserve.engine.sampler import sample  # noqa: E402
from llmserve.engine.sequence import SampleRow  # noqa: E402

ROWS = 32
VOCAB = 49152


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    tok = tokenizer()
    compiler = ConstraintCompiler(Vocabulary(tok, VOCAB, (tok.eos_token_id,)))
    start = time.perf_counter()
    compiled = compiler.submit(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"]))).result()
    cold_ms = (time.perf_counter() - start) * 1e3  # includes the library's tokenizer, built once per process
    start = time.perf_counter()
    compiler.submit(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["flat"]))).result()
    warm_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiler.submit(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["flat"]))).result()
    cached_ms = (time.perf_counter() - start) * 1e3
    ids = tok.encode(DOCUMENT, add_special_tokens=False)  # json.dumps writes ", " and ": ", as the grammar wants
    states = []
    for i in range(ROWS):
        state = compiled.start()
        for t in ids[: i % (len(ids) - 2)]:
            assert state.accept(t), state.error
        states.append(state)
    params = SamplingParams(temperature=0.7)
    plain = [SampleRow(params, i, i, [], (), False, 0) for i in range(ROWS)]
    constrained = [SampleRow(params, i, ROWS + i, [], (), False, 0, constraint=s) for i, s in enumerate(states)]
    streams = Generators()  # each row's stream goes on from round to round, as a sequence's does
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    times: dict[str, list[float]] = {"unconstrained": [], "constrained": [], "fill": []}
    for _ in range(args.rounds):
        for name, rows in (("unconstrained", plain), ("constrained", constrained)):
            start = time.perf_counter()
            sample(logits, rows, streams)
            times[name].append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        TokenMasks.shared().bitmask(states, VOCAB)
        times["fill"].append((time.perf_counter() - start) * 1e3)
    report = {f"{k}_ms_median": round(statistics.median(v), 3) for k, v in times.items()}
    report |= {f"{k}_ms_p90": round(sorted(v)[int(0.9 * len(v))], 3) for k, v in times.items()}
    report |= {
        "compile_cold_ms": round(cold_ms, 1),
        "compile_warm_ms": round(warm_ms, 2),
        "cached_ms": round(cached_ms, 3),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
