"""What a step costs when it carries pooling tokens beside decoding streams, in process.

The engine core's own step (benchmarks/probes/decode_step.py's way of timing it) with `G` greedy sequences
decoding, alone and beside a backlog of pooling requests (Embed inputs on the default model with `--pooling
last`, 60 tokens each) with the scheduler's pooling cap fixed at P tokens a step. Rounds alternate the caps; the
figure per cap is the median over rounds of each round's median step time. From the figures, a step's cost as
T(P) = T(0) + M [P > 0] + c P: M is what a step pays for carrying a prompt chunk at all (it leaves the compiled
step program for the fused forward's loop, SDPA over the chunk), c what each pooling token adds. With M large
against c P, pooling in fewer, larger chunks (Scheduler.pooling_cap's credit) keeps more of generation's rate
than the same tokens spread over every step.

    python benchmarks/probes/mixed_step.py [--streams 32] [--caps 0 8 16 32 64] [--steps 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
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
from llmserve.engine.types.pooling import PoolingMode  # noqa: E402
from llmserve.engine.types.request import GenerationRequest, PoolingParams, StoppingParams  # noqa: E402
from llmserve.models.loader import load_model  # noqa: E402

PROMPT = 16
POOLED = 60


def _pooled(core: EngineCore, tag: str, count: int, g: torch.Generator) -> None:
    """`count` pooling requests of random prompts (none found in the prefix cache)."""
    for i in range(count):
        prompt = tuple(int(t) for t in torch.randint(3, core.loaded.vocab_size, (POOLED,), generator=g))
        core.submit(
            GenerationRequest(
                f"p{tag}-{i}", prompt, stopping=StoppingParams(1), pooling=PoolingParams(PoolingMode.LAST)
            )
        )


def round_ms(core: EngineCore, streams: int, cap: int, steps: int, seed: int) -> float:
    """The median time (ms) of `steps` steps of `streams` decoding sequences, beside pooling work capped at `cap`
    tokens a step (0: none)."""
    scheduler = core.scheduler
    g = torch.Generator().manual_seed(seed * 1000 + cap)
    vocab = core.loaded.vocab_size
    stopping = StoppingParams(max_new_tokens=steps + 4, ignore_eos=True)
    # The cap fixed at P every step: no F, no M (the core measured them at its warm-up).
    scheduler.pooling_share, scheduler.pooling_step_tokens, scheduler.pooling_chunk_tokens = 1.0, 0, 0
    for i in range(streams):
        prompt = tuple(int(t) for t in torch.randint(vocab, (PROMPT,), generator=g))
        core.submit(GenerationRequest(f"r{seed}-{cap}-{i}", prompt, stopping=stopping))
    core.drain_inbox()
    while scheduler.num_waiting or any(s.num_computed < s.num_prompt for s in scheduler.running):
        core.step()
    if cap:
        # With F = 0 the cap beside G generating sequences is floor(G s / (1 - s)): s = P / (P + G) gives P.
        scheduler.pooling_share = cap / (cap + streams)
        _pooled(core, f"{seed}-{cap}", 2 + steps * cap // POOLED, g)
        core.drain_inbox()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    scheduler.pooling_share = 1.0
    while scheduler.has_work:
        core.step()
    core.take_outputs()
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--caps", nargs="+", type=int, default=[0, 8, 16, 32, 64])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loop", action="store_true", help="--no-compiled-steps: the fused forward's loop throughout")
    args = p.parse_args(argv)
    loaded = load_model(None, device="cpu", pooling="last")
    config = EngineConfig(kv_cache_tokens=16384, max_num_seqs=256, compiled_steps=not args.loop)
    core = EngineCore(loaded, config)
    core.warm_up()
    core.take_outputs()
    print(f"CPU {cpu_features.cpu_name()}, level {cpu_features.cpu_level()}, {torch.get_num_threads()} threads")
    print(f"{core.backend.description}; {args.streams} streams decoding")
    results: dict[int, list[float]] = {cap: [] for cap in args.caps}
    for r in range(args.rounds):
        order = args.caps if r % 2 == 0 else list(reversed(args.caps))
        for cap in order:
            results[cap].append(round_ms(core, args.streams, cap, args.steps, seed=r))
        print(f"round {r}: " + ", ".join(f"P={cap} {results[cap][-1]:.1f} ms" for cap in args.caps), flush=True)
    base = statistics.median(results[args.caps[0]])
    print(f"{'P':>4} {'ms/step':>9} {'vs P=' + str(args.caps[0]):>9} {'kept':>6}")
    for cap in args.caps:
        ms = statistics.median(results[cap])
        print(f"{cap:4d} {ms:9.2f} {ms - base:+9.2f} {base / ms:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
