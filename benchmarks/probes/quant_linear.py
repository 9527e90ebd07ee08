"""Linears over GGUF block types (quant.QuantLinear) against what torch offers on the CPU (issue 42).

Systems, each on a decoder layer's projections (qkv, o, gate_up, down, as the fused forward runs them) of a
shape, at M = 1, 4, 32, 256 rows:
- `f32`: packed_linear's float32 oneDNN linear (the yardstick), `plain`: F.linear on the float32 weight (what an
  `nn.Linear` runs: torch's BLAS, MKL in the x86 build), `int8`: its u8 x s8 linear with per-row activation
  scales (activation quantization included);
- `int4pack` / `int4pack-bf16`: torch's `_weight_int4pack_mm_for_cpu` (4-bit weights, group-wise scales and zeros:
  represents Q4_0/Q4_1/Q4_K exactly in float32), float32 / bfloat16 activations (the conversions included);
- `quant:TYPE[:LEVEL]`: QuantLinear on random blocks of TYPE (its bytes as a file holds them); `quantf:...` the same
  with float32 activations;
- `read`: the machine's read bandwidth in the same run: a sum over as many bytes as a Q8_0 layer holds (each copy's
  own buffer), the yardstick for GB/s at one row.

Systems alternate within each round so that all see the same load; the figure is the median over rounds of the
per-call time. On a machine shared with other work, `--clock cpu` (one thread) counts the calling thread's CPU time
instead of wall time, so that time the scheduler gives to other processes is not counted, and `--stat min` takes
the least disturbed round. Reports ms per layer,
GB/s of the weights' bytes (the bandwidth-bound figure at small M) and GFLOP/s (the compute-bound one at large
M). Each call runs the next of `--layers` copies of the layer's weights,
so that weights come from memory (or the last-level cache) as in a model, not from a core's own cache.

    python benchmarks/probes/quant_linear.py --shape smollm2 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

from llmserve.process_settings import configure_process  # noqa: E402

configure_process()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from llmserve.engine.backends.cpu import native, packed_linear  # noqa: E402
from llmserve.engine.backends.cpu import quant as q  # noqa: E402

# (hidden, intermediate, query heads, kv heads, head dim)
SHAPES = {
    "smollm2": (576, 1536, 9, 3, 64),
    "llama1b": (2048, 8192, 32, 8, 64),
    "llama8b": (4096, 14336, 32, 8, 128),
}
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2)}


def projections(shape: str) -> list[tuple[int, int]]:
    hidden, inter, heads, kv, dim = SHAPES[shape]
    return [((heads + 2 * kv) * dim, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter)]


def random_blocks(kind: q.GGMLType, rows: int, cols: int, rng: np.random.Generator) -> q.QuantWeight:
    """Random quants with small valid float16 scales: speed does not depend on the values."""
    per_block = q.block_size(kind)
    nbytes = q.row_bytes(kind, per_block)
    data = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
    for at in HALVES.get(kind.name, (208,)):
        data[:, at : at + 2] = (
            (rng.standard_normal(data.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return q.QuantWeight(kind, rows, cols, torch.from_numpy(data.reshape(rows, -1)))


def system(
    name: str, shapes: list[tuple[int, int]], rng: np.random.Generator, copies: int
) -> tuple[Callable[[torch.Tensor, int], None], int]:
    """A callable running the next of `copies` layers' projections on M rows (inputs of each width made inside),
    and the bytes of one layer's weights."""
    built = [layer(name, shapes, rng) for _ in range(copies)]
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    turn = [0]

    def run(_: torch.Tensor, m: int) -> None:
        layers = built[turn[0] % copies][0]
        turn[0] += 1
        for (_, k), project in zip(shapes, layers, strict=True):
            x = inputs.setdefault((m, k), torch.randn(m, k))
            project(x)

    return run, built[0][1]


def layer(
    name: str, shapes: list[tuple[int, int]], rng: np.random.Generator
) -> tuple[list[Callable[..., object]], int]:
    """One layer's projections in system `name`, and their bytes."""
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    if name == "read":  # the machine's read bandwidth on a layer's bytes of Q8_0 (a STREAM-like sum, torch's threads)
        size = sum(n * k * 34 // 32 for n, k in shapes) // 4
        buffer = torch.randn(size)
        layers = [lambda x, b=buffer: b.sum()] + [lambda x: None] * (len(shapes) - 1)
        nbytes = size * 4
    elif name == "f32":
        layers = [packed_linear.PackedF32(packed_linear.pack_weight(w), None) for w in weights]
        nbytes = sum(w.numel() * 4 for w in weights)
    elif name == "plain":
        layers = [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]
        nbytes = sum(w.numel() * 4 for w in weights)
    elif name == "int8":
        ops = native.load_mixed()
        assert ops is not None
        int8 = [packed_linear.Int8Linear.of(w, None, ops, torch.float32) for w in weights]
        layers = [lambda x, lin=lin: lin(ops.convert(x, torch.uint8)) for lin in int8]  # type: ignore[misc]
        nbytes = sum(w.numel() for w in weights)
    elif name in ("int4pack", "int4pack-bf16"):
        dtype = torch.bfloat16 if name == "int4pack-bf16" else torch.float32
        layers = []
        for n, k in shapes:
            qv = torch.randint(0, 16, (n, k), dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qv, 1)
            sz = (torch.randn(k // 32, n, 2) * 0.01).to(dtype)
            layers.append(
                lambda x, p=packed, s=sz, t=dtype: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(t), p, 32, s).float()
            )
        nbytes = sum(n * k // 2 + n * k // 32 * 4 * dtype.itemsize for n, k in shapes)
    else:
        system_, kind, *level = name.split(":")
        acts = "float32" if system_ == "quantf" else "int8"
        linears = [
            q.QuantLinear(random_blocks(q.GGMLType[kind], n, k, rng), level[0] if level else None, acts)
            for n, k in shapes
        ]
        layers = linears
        nbytes = sum(lin.nbytes for lin in linears)
    return layers, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 256])
    default = ["f32", "int8", "int4pack-bf16", "quant:Q4_0", "quant:Q4_1", "quant:Q8_0", "quant:Q4_K", "quant:Q6_K"]
    parser.add_argument("--systems", nargs="+", default=default)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=8, help="copies of the layer's weights, called in turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--stat", choices=["median", "min"], default="median", help="over the rounds")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu counts the calling thread only: use --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shapes = projections(args.shape)
    flops_per_row = sum(2 * n * k for n, k in shapes)
    built = {name: system(name, shapes, rng, args.layers) for name in args.systems}
    print(f"# {args.shape} layer {shapes}, {args.threads} threads, {args.layers} copies")
    print(f"# {args.clock} clock, {args.stat} of {args.rounds} rounds")
    print(f"# kernel level {q.kernel_level()}, LLMSERVE_CPU_ISA={os.environ.get('LLMSERVE_CPU_ISA', '')}")
    print("| system | bytes/layer | " + " | ".join(f"M={m} ms (GB/s, GFLOP/s)" for m in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    table: dict[str, list[str]] = {name: [] for name in built}
    with torch.inference_mode():
        for m in args.rows:
            calls = max(1, int(2e9 // max(flops_per_row * m, 1)) // 20)  # about 0.1 s of work a window
            times: dict[str, list[float]] = {name: [] for name in built}
            for run, _ in built.values():
                run(torch.empty(0), m)  # warm: oneDNN primitives, pages
            for _ in range(args.rounds):
                for name, (run, _) in built.items():
                    start = clock()
                    for _ in range(calls):
                        run(torch.empty(0), m)
                    times[name].append((clock() - start) / calls)
            for name, (_, nbytes) in built.items():
                t = min(times[name]) if args.stat == "min" else statistics.median(times[name])
                table[name].append(f"{t * 1e3:.3f} ({nbytes / t / 1e9:.1f}, {flops_per_row * m / t / 1e9:.0f})")
    for name, (_, nbytes) in built.items():
        print(f"| {name} | {nbytes / 1e6:.2f} MB | " + " | ".join(table[name]) + " |")


if __name__ == "__main__":
    main()
