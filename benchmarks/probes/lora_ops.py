"""Probe: three ways to add a step's LoRA deltas to one projection, at SmolLM2-135M's shapes (issue 32).

Every row (token) of a step names a device slot (an adapter) or none; each projection's output gets
y += scale[slot] * (x @ A[slot]^T) @ B[slot]^T for the rows with a slot. The ways compared, each one batched
operation per projection over all rows:
- gather: each row gathers its slot's A and B and multiplies in one bmm (vLLM's torch `bgmv_shrink/expand`);
- segments: rows grouped by slot (argsort), one pair of matmuls per adapter segment, added back by index
  (`sgmv`); `segments-sorted` is the same over rows already contiguous by adapter (no gather or scatter);
- masked: one matmul with every slot's A stacked ([slots * rank, in]), a per-row mask that keeps the row's own
  slot's columns (scaled), one matmul with every slot's B: ops.py's way (`LoraRows`, `add_lora`).
Also timed: the projection's own F.linear, as the scale the deltas are measured against. Rounds alternate the ways
(each round times every way), so that the machine's drift cancels; the figure is the median of the rounds' medians.

    flock -x /work/cpu.lock .venv/bin/python benchmarks/probes/lora_ops.py            # 32 decode rows, 4 adapters
    flock -x /work/cpu.lock .venv/bin/python benchmarks/probes/lora_ops.py --tokens 512  # a prefill chunk

The figures that chose ops.py's way are in benchmarks/README.md (Lab notebook: LoRA ops).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paths import make_importable  # noqa: E402

make_importable()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmserve.engine.lora.ops import LoraRows, StackedProjection, add_lora  # noqa: E402

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query heads and 3 kv heads of dim 64.
PROJECTIONS = {
    "q_proj": (576, 576),
    "k_proj": (576, 192),
    "v_proj": (576, 192),
    "o_proj": (576, 576),
    "gate_proj": (576, 1536),
    "up_proj": (576, 1536),
    "down_proj": (1536, 576),
}

Way = Callable[[torch.Tensor, torch.Tensor], None]


def ways(
    a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
) -> dict[str, Way]:
    """Each way as a function (x, y) -> None that adds the deltas into y. a [S, R, in], b [S, out, R]."""
    num_slots, rank, _ = a.shape
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots, minlength=num_slots).tolist()
    segments = []
    at = 0
    for s, n in enumerate(counts):
        if n:
            segments.append((s, order[at : at + n], at, at + n))
        at += n
    stacked = StackedProjection.empty(num_slots, rank, a.shape[2], b.shape[1], a.dtype)
    for s in range(num_slots):
        stacked.write(s, a[s], b[s], float(scale[s]))
    rows = LoraRows.of(slots, num_slots, rank)
    row_scale = scale[slots][:, None, None]

    def base(x: torch.Tensor, y: torch.Tensor) -> None:
        torch.addmm(y, x, weight.t(), out=y)

    def gather(x: torch.Tensor, y: torch.Tensor) -> None:
        shrunk = torch.bmm(a[slots], x[:, :, None])  # [T, R, 1]
        y += torch.bmm(b[slots], shrunk * row_scale)[:, :, 0]

    def segmented(x: torch.Tensor, y: torch.Tensor) -> None:
        for s, idx, _, _ in segments:
            part = (x.index_select(0, idx) @ a[s].t()) @ b[s].t()
            y.index_add_(0, idx, part, alpha=float(scale[s]))

    def sorted_segments(x: torch.Tensor, y: torch.Tensor) -> None:
        # The rows as if the batch had been ordered by adapter: contiguous views, nothing gathered.
        for s, _, lo, hi in segments:
            y[lo:hi].addmm_(x[lo:hi] @ a[s].t(), b[s].t(), alpha=float(scale[s]))

    def masked(x: torch.Tensor, y: torch.Tensor) -> None:
        add_lora(x, y, stacked, rows)

    return {
        "base linear": base,
        "gather": gather,
        "segments": segmented,
        "segments-sorted": sorted_segments,
        "masked": masked,
    }


def check_agree(fns: dict[str, Way], x: torch.Tensor, y0: torch.Tensor) -> None:
    """Every LoRA way adds the same deltas (float32 rounding apart)."""
    results = {}
    for name, fn in fns.items():
        if name == "base linear":
            continue
        y = y0.clone()
        fn(x, y)
        results[name] = y
    ref = results["gather"]
    for name, y in results.items():
        err = float((y - ref).abs().max())
        if err > 1e-4:
            raise SystemExit(f"{name} disagrees with gather by {err}")


def time_round(fn: Way, x: torch.Tensor, y: torch.Tensor, reps: int) -> float:
    """Median microseconds per call over `reps` calls."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x, y)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="rows in the step (decode: one per sequence)")
    parser.add_argument("--adapters", type=int, default=4, help="adapters in the step (= slots)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    # Decode rows take their adapters interleaved (a batch is never ordered by adapter); a prefill chunk's tokens
    # come in contiguous runs, one per sequence.
    if args.tokens <= 64:
        slots = torch.arange(args.tokens) % args.adapters
    else:
        slots = torch.arange(args.tokens) * args.adapters // args.tokens
    out: dict[str, dict[str, float]] = {}
    for name, (fan_in, fan_out) in PROJECTIONS.items():
        a = torch.randn(args.adapters, args.rank, fan_in, generator=gen) * 0.05
        b = torch.randn(args.adapters, fan_out, args.rank, generator=gen) * 0.05
        scale = torch.full((args.adapters,), 2.0)
        weight = torch.randn(fan_out, fan_in, generator=gen) * 0.05
        x = torch.randn(args.tokens, fan_in, generator=gen)
        y = torch.zeros(args.tokens, fan_out)
        fns = ways(a, b, scale, slots, weight)
        check_agree(fns, x, y)
        for fn in fns.values():  # warm-up: oneDNN primitives, allocator
            for _ in range(20):
                fn(x, y)
        rounds: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for way, fn in fns.items():
                rounds[way].append(time_round(fn, x, y, args.reps))
        out[name] = {way: statistics.median(v) for way, v in rounds.items()}
    ways_named = list(next(iter(out.values())))
    print(
        f"{args.tokens} rows over {args.adapters} adapters of rank {args.rank}, {torch.get_num_threads()} threads: "
        "median us per call"
    )
    print(f"{'projection':<10}" + "".join(f"{w:>17}" for w in ways_named))
    for name, figures in out.items():
        print(f"{name:<10}" + "".join(f"{figures[w]:>17.1f}" for w in ways_named))
    totals = {w: sum(f[w] for f in out.values()) for w in ways_named}
    print(f"{'per layer':<10}" + "".join(f"{totals[w]:>17.1f}" for w in ways_named))
    if args.json:
        record = {"tokens": args.tokens, "adapters": args.adapters, "rank": args.rank, "us": out, "per_layer": totals}
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
