"""Probe: ways to add a step's LoRA deltas to one projection, at SmolLM2-135M's shapes (issue 32).

Every row (token) of a step names a device slot (an adapter) or none; each projection's output gets
y += scale[slot] * (x @ A[slot]^T) @ B[slot]^T for the rows with a slot. The ways compared, each batched over all
rows of the step:
- gather: each row gathers its slot's A and B and multiplies in one bmm (vLLM's torch `bgmv_shrink/expand`);
- segments: rows grouped by slot (argsort), one pair of matmuls per adapter segment, added back by index
  (`sgmv`); `segments-sorted` is the same over rows already contiguous by adapter (no gather or scatter);
- masked: one matmul with every slot's A stacked ([slots * rank, in]), a per-row mask that keeps the row's own
  slot's columns, one matmul with every slot's B;
- grouped: every slot's rows gathered into one [slots, rows of the largest group, in] batch (padded), one bmm
  with the slots' A, one with their B, added back by index;
- add_lora: ops.py as served (grouped rows, and runs of SEGMENT_ROWS or more as contiguous segments).
Also timed: the projection's own F.linear, as the scale the deltas are measured against. Rounds alternate the ways
(each round times every way), so that the machine's drift cancels; the figure is the median of the rounds' medians.

    python benchmarks/run.py --mode lora-ops                 # 32 decode rows over 4 adapters of rank 16
    python benchmarks/run.py --mode lora-ops --tokens 512    # four prompt chunks of 128 rows
    python benchmarks/run.py --mode lora-ops --chunk 480     # 32 decode rows and one 480-row chunk

The figures that chose ops.py's way are in benchmarks/README.md (Lab notebook: LoRA ops).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmserve.engine.lora.adapters import LoraModule
from llmserve.engine.lora.ops import LoraRows, add_lora
from llmserve.engine.lora.weights import StackedProjection

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
        stacked.write(s, [LoraModule(a[s], b[s], float(scale[s]))])
    rows = LoraRows.of(slots, num_slots)
    # masked: every slot's factors stacked, the scale folded into B; a row keeps its own slot's columns.
    a_all = a.reshape(num_slots * rank, -1)
    bt_all = (b * scale[:, None, None]).transpose(1, 2).reshape(num_slots * rank, -1)
    mask = (slots[:, None] == torch.arange(num_slots)).float().repeat_interleave(rank, dim=1)
    if rows is None:
        raise SystemExit("no row has an adapter")
    # grouped (all rows, however long their runs): the rows of each slot gathered into [slots, most rows of a slot,
    # in] (short groups padded with row 0, their shrunk rows zeroed), one bmm each way with the slots' own factors,
    # the results added back by index.
    longest = max(counts)
    gidx = torch.zeros(num_slots, longest, dtype=torch.long)
    keep = torch.zeros(num_slots, longest, 1)
    for s, idx, lo, hi in segments:
        gidx[s, : hi - lo] = idx
        keep[s, : hi - lo] = float(scale[s])
    gidx = gidx.view(-1)
    at = a.transpose(1, 2).contiguous()  # [S, in, R]
    bt = b.transpose(1, 2).contiguous()  # [S, R, out]
    row_scale = scale[slots][:, None, None]

    def base(x: torch.Tensor, y: torch.Tensor) -> None:
        torch.addmm(y, x, weight.t(), out=y)

    def gather(x: torch.Tensor, y: torch.Tensor) -> None:
        shrunk = torch.bmm(a[slots], x[:, :, None])  # [T, R, 1]
        y += torch.bmm(b[slots], shrunk * row_scale)[:, :, 0]

    def grouped(x: torch.Tensor, y: torch.Tensor) -> None:
        shrunk = torch.bmm(x.index_select(0, gidx).view(num_slots, longest, -1), at)
        shrunk.mul_(keep)
        y.index_add_(0, gidx, torch.bmm(shrunk, bt).view(num_slots * longest, -1))

    def segmented(x: torch.Tensor, y: torch.Tensor) -> None:
        for s, idx, _, _ in segments:
            part = (x.index_select(0, idx) @ a[s].t()) @ b[s].t()
            y.index_add_(0, idx, part, alpha=float(scale[s]))

    def sorted_segments(x: torch.Tensor, y: torch.Tensor) -> None:
        # The rows as if the batch had been ordered by adapter: contiguous views, nothing gathered.
        for s, _, lo, hi in segments:
            y[lo:hi].addmm_(x[lo:hi] @ a[s].t(), b[s].t(), alpha=float(scale[s]))

    def masked(x: torch.Tensor, y: torch.Tensor) -> None:
        shrunk = torch.mm(x, a_all.t())
        shrunk.mul_(mask)
        y.addmm_(shrunk, bt_all)

    def served(x: torch.Tensor, y: torch.Tensor) -> None:
        add_lora(x, y, stacked, rows)

    return {
        "base linear": base,
        "gather": gather,
        "segments": segmented,
        "grouped": grouped,
        "segments-sorted": sorted_segments,
        "masked": masked,
        "add_lora": served,
    }


def check_agree(fns: dict[str, Way], x: torch.Tensor, y0: torch.Tensor, slots: torch.Tensor) -> None:
    """Every LoRA way adds the same deltas (float32 rounding apart); segments-sorted over the rows in adapter
    order, as it would see them."""
    order = torch.argsort(slots, stable=True)
    results = {}
    for name, fn in fns.items():
        if name == "base linear":
            continue
        sort = name == "segments-sorted"
        y = y0[order].clone() if sort else y0.clone()
        fn(x[order] if sort else x, y)
        results[name] = y[torch.argsort(order)] if sort else y
    ref = results["gather"]
    for name, y in results.items():
        err = float((y - ref).abs().max())
        if err > 1e-4:
            raise SystemExit(f"{name} disagrees with gather by {err}")


def time_fused(slots: torch.Tensor, args: argparse.Namespace, gen: torch.Generator) -> dict[str, tuple[float, float]]:
    """add_lora over a fused linear (q/k/v, gate/up: one shrink, an expand per projection) against one call per
    projection."""
    groups = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
    rows = LoraRows.of(slots, args.adapters)
    if rows is None:
        raise SystemExit("no row has an adapter")
    out = {}
    for group, names in groups.items():
        fan_in = PROJECTIONS[names[0]][0]
        outs = tuple(PROJECTIONS[n][1] for n in names)
        one = StackedProjection.empty(args.adapters, args.rank, fan_in, outs, torch.float32)
        each = [StackedProjection.empty(args.adapters, args.rank, fan_in, o, torch.float32) for o in outs]
        for s in range(args.adapters):
            modules = [
                LoraModule(torch.randn(args.rank, fan_in, generator=gen), torch.randn(o, args.rank, generator=gen), 2.0)
                for o in outs
            ]
            one.write(s, list(modules))
            for proj, module in zip(each, modules, strict=True):
                proj.write(s, [module])
        x = torch.randn(args.tokens, fan_in, generator=gen)
        y = torch.zeros(args.tokens, sum(outs))
        parts = [torch.zeros(args.tokens, o) for o in outs]

        def fused(x: torch.Tensor, y: torch.Tensor, one: StackedProjection = one) -> None:
            add_lora(x, y, one, rows)

        def separate(
            x: torch.Tensor, y: torch.Tensor, each: list[StackedProjection] = each, parts: list[torch.Tensor] = parts
        ) -> None:
            for proj, part in zip(each, parts, strict=True):
                add_lora(x, part, proj, rows)

        for fn in (fused, separate):
            for _ in range(20):
                fn(x, y)
        rounds: list[tuple[float, float]] = []
        for _ in range(args.rounds):
            rounds.append((time_round(fused, x, y, args.reps), time_round(separate, x, y, args.reps)))
        out[group] = (statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds))
    return out


def time_round(fn: Way, x: torch.Tensor, y: torch.Tensor, reps: int) -> float:
    """Median microseconds per call over `reps` calls."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x, y)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py --mode lora-ops", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="rows in the step (decode: one per sequence)")
    parser.add_argument("--chunk", type=int, default=0, help="a prompt chunk of this many rows (adapter 0) after them")
    parser.add_argument("--adapters", type=int, default=4, help="adapters in the step (= slots)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    # Decode rows take their adapters interleaved (a batch is never ordered by adapter); a prefill chunk's tokens
    # come in contiguous runs, one per sequence.
    if args.tokens <= 64:
        slots = torch.arange(args.tokens) % args.adapters
    else:
        slots = torch.arange(args.tokens) * args.adapters // args.tokens
    slots = torch.cat([slots, torch.zeros(args.chunk, dtype=torch.long)])
    args.tokens += args.chunk
    out: dict[str, dict[str, float]] = {}
    for name, (fan_in, fan_out) in PROJECTIONS.items():
        a = torch.randn(args.adapters, args.rank, fan_in, generator=gen) * 0.05
        b = torch.randn(args.adapters, fan_out, args.rank, generator=gen) * 0.05
        scale = torch.full((args.adapters,), 2.0)
        weight = torch.randn(fan_out, fan_in, generator=gen) * 0.05
        x = torch.randn(args.tokens, fan_in, generator=gen)
        y = torch.zeros(args.tokens, fan_out)
        fns = ways(a, b, scale, slots, weight)
        check_agree(fns, x, y, slots)
        for fn in fns.values():  # warm-up: oneDNN primitives, allocator
            for _ in range(20):
                fn(x, y)
        rounds: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for way, fn in fns.items():
                rounds[way].append(time_round(fn, x, y, args.reps))
        out[name] = {way: statistics.median(v) for way, v in rounds.items()}
    fused = time_fused(slots, args, gen)
    ways_named = list(next(iter(out.values())))
    chunk = f" (the last {args.chunk} one prompt chunk)" if args.chunk else ""
    print(
        f"{args.tokens} rows{chunk} over {args.adapters} adapters of rank {args.rank}, "
        f"{torch.get_num_threads()} threads: median us per call"
    )
    print(f"{'projection':<10}" + "".join(f"{w:>16}" for w in ways_named))
    for name, figures in out.items():
        print(f"{name:<10}" + "".join(f"{figures[w]:>16.1f}" for w in ways_named))
    totals = {w: sum(f[w] for f in out.values()) for w in ways_named}
    print(f"{'per layer':<10}" + "".join(f"{totals[w]:>16.1f}" for w in ways_named))
    print("add_lora on the CPU forward's fused linears: one call over the group vs one call per projection (us)")
    for group, (one, each) in fused.items():
        print(f"{group:<10}{one:>17.1f}{each:>17.1f}")
    if args.json:
        record = {
            "tokens": args.tokens,
            "chunk": args.chunk,
            "adapters": args.adapters,
            "rank": args.rank,
            "threads": torch.get_num_threads(),
            "us": out,
            "per_layer": totals,
            "fused_us": fused,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0
