"""Decode steps in process: the engine core's own step (scheduler, plan, forward, sampling, outputs) timed with
`batch` sequences decoding, for a model and dtype as the server would load them.

Each system is loaded in turn, warmed, then `--rounds` rounds alternate the systems; per round each keeps `batch`
greedy sequences (a short prompt, EOS ignored) decoding for `--steps` steps after their prompts, and the figure is
the median step time over rounds (of each round's median). So it counts what a decoding stream pays per token
inside the engine, without the gRPC edge or the process boundary (benchmarks/modes/gguf_blocks.py measures those).

    python benchmarks/probes/decode_step.py --systems gguf:default float32:default gguf:Q8_0=FILE --batches 1 32
    LLMSERVE_CPU_ISA=avx2 python benchmarks/probes/decode_step.py ...   # at a capped level

A system is DTYPE[/ACTIVATIONS]:MODEL[@loop], MODEL `default` (the shipped GGUF) or a path, `@loop` with
--no-compiled-steps (the fused forward's Python loop); ACTIVATIONS as --gguf-activations, float32 unless given (the
server's default); e.g. `gguf/int8:default`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

from llmserve.process_settings import configure_process  # noqa: E402

configure_process()

import torch  # noqa: E402

from llmserve import cpu_features  # noqa: E402
from llmserve.engine.config import EngineConfig  # noqa: E402
from llmserve.engine.core.engine_core import EngineCore  # noqa: E402
from llmserve.engine.types.request import GenerationRequest, StoppingParams  # noqa: E402
from llmserve.models.loader import load_model  # noqa: E402

PROMPT = 16


def load(system: str) -> EngineCore:
    system, _, variant = system.partition("@")
    dtype, _, spec = system.partition(":")
    dtype, _, activations = dtype.partition("/")
    spec = "" if spec == "default" else spec.split("=", 1)[-1]
    loaded = load_model(spec or None, device="cpu", dtype=dtype, gguf_activations=activations or "float32")
    config = EngineConfig(kv_cache_tokens=8192, max_num_seqs=256, compiled_steps=variant != "loop")
    core = EngineCore(loaded, config)
    core.warm_up()
    core.take_outputs()
    return core


def round_ms(core: EngineCore, batch: int, steps: int, seed: int) -> float:
    """The median step time (ms) of `steps` steps with `batch` sequences decoding, after their prompts."""
    g = torch.Generator().manual_seed(seed)
    vocab = core.loaded.vocab_size
    stopping = StoppingParams(max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        prompt = tuple(int(t) for t in torch.randint(vocab, (PROMPT,), generator=g))
        core.submit(GenerationRequest(f"r{seed}-{i}", prompt, stopping=stopping))
    core.drain_inbox()
    while core.scheduler.num_waiting or any(s.num_computed < s.num_prompt for s in core.scheduler.running):
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    while core.scheduler.has_work:
        core.step()
    core.take_outputs()
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=["gguf:default", "gguf/int8:default", "float32:default"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    cores = {s: load(s) for s in args.systems}
    print(f"CPU {cpu_features.cpu_name()}, level {cpu_features.cpu_level()}, {torch.get_num_threads()} threads")
    for s, core in cores.items():
        print(f"{s}: {core.backend.description}")
    results: dict[str, dict[str, list[float]]] = {s: {str(b): [] for b in args.batches} for s in cores}
    for r in range(args.rounds):
        order = list(cores) if r % 2 == 0 else list(reversed(cores))
        for batch in args.batches:
            for s in order:
                results[s][str(batch)].append(round_ms(cores[s], batch, args.steps, seed=r))
    print(f"{'system':32} " + " ".join(f"{'B=' + str(b) + ' ms/step':>16} {'tok/s':>9}" for b in args.batches))
    for s in cores:
        cells = []
        for b in args.batches:
            ms = statistics.median(results[s][str(b)])
            cells.append(f"{ms:16.2f} {1e3 * b / ms:9.1f}")
        print(f"{s:32} " + " ".join(cells))
    if args.json is not None:
        args.json.write_text(json.dumps({"level": cpu_features.cpu_level(), "ms": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
