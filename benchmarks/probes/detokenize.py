"""Detokenization per engine step: one `IncrementalDetokenizer.push` per running sequence, on the step thread.

The default model's tokenizer, README text as the generated ids, with and without a stop sequence. Compares the
tokenizer's own `decode` (transformers' Python layers around the Rust tokenizer) with the Rust backend's decode
that the detokenizer uses where the two agree, alternated in one run.

    python benchmarks/probes/detokenize.py [--sequences 256] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paths import make_importable  # noqa: E402

make_importable()

from transformers import AutoTokenizer  # noqa: E402

from llmserve.engine import detokenizer  # noqa: E402
from llmserve.models import convert_gguf, default_gguf_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def step_ms(tokenizer: object, ids: list[int], sequences: int, steps: int, stops: list[str]) -> float:
    """Median milliseconds for one step's pushes, one token to each of `sequences` detokenizers."""
    dets = [detokenizer.IncrementalDetokenizer(tokenizer, stops) for _ in range(sequences)]
    times = []
    for step in range(steps):
        started = time.perf_counter()
        for i, det in enumerate(dets):
            det.push([ids[(step + i * 7) % len(ids)]])
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()), local_files_only=True)
    ids = tokenizer.encode((ROOT / "README.md").read_text())
    backend = detokenizer._tokenizer_facts(tokenizer)
    own = detokenizer._TokenizerFacts(
        backend.byte_ids, backend.special_ids, lambda i, skip: tokenizer.decode(i, skip_special_tokens=skip)
    )
    print(f"{type(tokenizer).__name__}: the detokenizer decodes with {backend.decode.__name__!r}")
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, facts in (("tokenizer.decode", own), ("backend decode", backend)):
            detokenizer._facts_cache[tokenizer] = facts
            for stops in ([], ["\n\nUser:"]):
                key = (name, "one stop sequence" if stops else "no stop sequence")
                results.setdefault(key, []).append(step_ms(tokenizer, ids, args.sequences, args.steps, stops))
    for (name, stops), times in results.items():
        shown = " / ".join(f"{t:.2f}" for t in times)
        print(f"{name:17s} {stops:18s}: {shown} ms per step of {args.sequences} pushes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
