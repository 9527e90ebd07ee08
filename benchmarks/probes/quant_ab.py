"""Two builds of the block kernels (`_quant_ops`) side by side in one process: quant_linear_f32 (float rows) on a
decoder layer's projections, ms per layer at each row count, the builds alternating inside every round.

For a machine shared with other work: one thread, the thread's CPU time, the least disturbed of `--rounds` rounds
(so the other processes' time is not counted; their cache and memory traffic still is). Each call runs the next of
8 copies of the layer's weights, as quant_linear.py does, so the weights come from memory. The packed layout must
be the same in both builds (QuantLinear packs with the installed one).

    cp server/llmserve/engine/backends/cpu/_quant_ops*.so /tmp/before.so   # then rebuild, then:
    python benchmarks/probes/quant_ab.py /tmp/before.so server/llmserve/engine/backends/cpu/_quant_ops*.so
"""

from __future__ import annotations

import argparse
import ctypes
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

from benchmarks.probes.quant_linear import SHAPES, projections, random_blocks  # noqa: E402
from llmserve.engine.backends.cpu import quant as q  # noqa: E402

COPIES = 8


def kernel(path: str) -> Callable[..., int]:
    fn = ctypes.CDLL(path).quant_linear_f32
    long, int_, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [int_, int_, ptr, long, long, ptr, long, ptr, long, int_]
    fn.restype = int_
    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 16, 32])
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    builds = {"before": kernel(args.before), "after": kernel(args.after)}
    rng = np.random.default_rng(0)
    shapes = projections(args.shape)
    print(f"# {args.shape}, one thread, thread CPU time, min of {args.rounds} rounds, ms per layer before -> after")
    print("| type | " + " | ".join(f"M={m}" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for kind in args.types:
        layers = [
            [q.QuantLinear(random_blocks(q.GGMLType[kind], n, k, rng), "avx2", "float32") for n, k in shapes]
            for _ in range(COPIES)
        ]
        cells = []
        for m in args.rows:
            xs = [torch.randn(m, k) for _, k in shapes]
            ys = [torch.empty(m, n) for n, _ in shapes]
            calls = max(COPIES, 40 // m)
            best = dict.fromkeys(builds, float("inf"))
            for turn in range(args.rounds):
                for name in sorted(builds, reverse=bool(turn % 2)):
                    start = time.thread_time()
                    for c in range(calls):
                        for linear, x, y in zip(layers[c % COPIES], xs, ys, strict=True):
                            level, type_, packed, n, k = linear.kernel_args() or (0, 0, 0, 0, 0)
                            if builds[name](level, type_, packed, n, k, x.data_ptr(), m, y.data_ptr(), n, 1):
                                raise RuntimeError(f"{name}: quant_linear_f32 failed")
                    best[name] = min(best[name], (time.thread_time() - start) / calls)
            cells.append(f"{best['before'] * 1e3:.3f} -> {best['after'] * 1e3:.3f}")
        print(f"| {kind} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
