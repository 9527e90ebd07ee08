"""n completions from one prompt (issue 22): one request with n = 4 vs four separate requests, on the llmserve engine
in-process with the default model.

Each round sends a fresh ~1,000-token prompt (a new one every run, so no run finds another's prompt in the prefix
cache) and generates `--max-new-tokens` sampled tokens per completion (EOS ignored): once as one request with n = 4,
once as four requests with the same prompt and the derived seeds, sent together. Rounds alternate the order (A B,
B A, ...), so that the machine's drift hits both alike. Per run: prompt tokens the engine computed (counted on the
scheduler's plans, and from usage as prompt minus cached), wall time until all four finished, generated tokens per
second over that wall time, and the time to the last of the four first tokens.

    python benchmarks/run.py --mode n [--rounds 3] [--prompt-tokens 1000] [--max-new-tokens 32] [--quick]

Writes benchmarks/results/<date>-cpu-n-completions.{md,json} (`make bench-n`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from benchmarks import options, writer
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.frontend.fanout import derive_seed
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import GenerationRequest, SamplingParams, StoppingParams

TITLE = "n = 4 completions vs four separate calls (issue 22)"
N = 4
MODES = ("n=4", "4 calls")
WORDS = "the a river stone city market light winter garden letter engine music harbor silver road".split()


class PromptCounter:
    """Counts the prompt tokens each step computes (positions below the sequence's prompt length)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.tokens = 0
        scheduler = engine.core.engine_core.scheduler
        real = scheduler.schedule

        def schedule() -> Any:
            plan = real()
            for entry in plan.seqs:
                self.tokens += max(0, min(entry.end, entry.seq.num_prompt) - entry.start)
            return plan

        scheduler.schedule = schedule  # type: ignore[method-assign]


def fresh_prompt(tok: Any, vocab_size: int, length: int, rng: random.Random) -> tuple[int, ...]:
    """A prompt of exactly `length` tokens that no earlier run sent (random words cut to length; random ids for a
    model without a tokenizer)."""
    if tok is None:
        return tuple(rng.randrange(3, vocab_size) for _ in range(length))
    ids: list[int] = []
    while len(ids) < length:
        ids += tok.encode(" ".join(rng.choice(WORDS) for _ in range(200)), add_special_tokens=False)
    return tuple(ids[:length])


async def one_run(
    engine: AsyncEngine, counter: PromptCounter, mode: str, prompt: tuple[int, ...], seed: int, args: argparse.Namespace
) -> dict[str, float]:
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=seed)
    stopping = StoppingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    if mode == "n=4":
        requests = [GenerationRequest(f"n-{seed}", prompt, sampling=sampling, stopping=stopping, n=N)]
    else:
        requests = [
            GenerationRequest(
                f"s-{seed}-{i}", prompt, sampling=SamplingParams(0.8, 50, seed=derive_seed(seed, i)), stopping=stopping
            )
            for i in range(N)
        ]
    counted_before = counter.tokens
    start = time.monotonic()
    firsts: dict[tuple[int, int], float] = {}
    generated = computed_by_usage = 0

    async def consume(k: int, request: GenerationRequest) -> None:
        nonlocal generated, computed_by_usage
        async for delta in engine.generate(request):
            if delta.token_ids:
                firsts.setdefault((k, delta.index), time.monotonic())
            generated += len(delta.token_ids)
            if delta.usage is not None:
                computed_by_usage += delta.usage.prompt_tokens - delta.usage.cached_prompt_tokens

    await asyncio.gather(*(consume(k, r) for k, r in enumerate(requests)))
    wall = time.monotonic() - start
    return {
        "prompt_tokens_computed": counter.tokens - counted_before,
        "prompt_tokens_computed_by_usage": computed_by_usage,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1),
        "last_first_token_s": round(max(firsts.values()) - start, 3),
        "generated": generated,
    }


async def measure(args: argparse.Namespace, loaded: LoadedModel) -> dict[str, Any]:
    engine = AsyncEngine(loaded, EngineConfig(kv_cache_tokens=32768, max_num_seqs=16, cuda_graphs=False))
    await engine.start()
    counter = PromptCounter(engine)
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            prompt = fresh_prompt(loaded.tokenizer, loaded.vocab_size, args.prompt_tokens, rng)
            runs[mode].append(await one_run(engine, counter, mode, prompt, 1000 + r, args))
            print({"round": r, "mode": mode, **runs[mode][-1]}, flush=True)
    await engine.shutdown()

    def median(mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[mode])

    return {
        "n": N,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "runs": runs,
        "median": {mode: {key: median(mode, key) for key in runs[mode][0]} for mode in MODES},
        "wall_ratio_median": round(median("4 calls", "wall_s") / median("n=4", "wall_s"), 3),
    }


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    med = result["median"]
    lines = [
        f"A fresh {result['prompt_tokens']}-token prompt per run, "
        f"{result['max_new_tokens']} sampled tokens per completion, {result['rounds']} rounds in alternated order "
        "(on a 2-core machine the times move with other work on it; the prompt token counts do not).",
        "",
    ]
    header = ["mode (median of rounds)", "prompt tokens computed", "(from usage)", "wall s", "tok/s"]
    rows = [
        [
            mode,
            f"{med[mode]['prompt_tokens_computed']:.0f}",
            f"{med[mode]['prompt_tokens_computed_by_usage']:.0f}",
            f"{med[mode]['wall_s']:.2f}",
            f"{med[mode]['tokens_per_s']:.1f}",
            f"{med[mode]['last_first_token_s']:.2f}",
        ]
        for mode in MODES
    ]
    lines += writer.table([*header, "last first token s"], rows)
    lines += [
        "",
        f"Wall time ratio (4 calls / n=4, medians): {result['wall_ratio_median']}.",
        "",
        f"With n = 4 the prompt is computed once: each other completion shares its full blocks, copies the partial "
        f"one and computes only the prompt's last token: {result['prompt_tokens']} + 3 x 1. Four separate calls sent "
        "together already share part of it through the prefix cache, by timing alone: the first is read in chunks "
        "of --max-num-batched-tokens (512), the second is admitted once the first chunk's blocks are cached and "
        "reads the rest itself, the last two find the whole prompt cached. Without a prefix cache they would "
        f"compute {N} x {result['prompt_tokens']}; n = 4 shares the prompt whatever the timing, also with "
        "--no-prefix-caching (tests/engine/test_fanout.py).",
        "",
        "Every run:",
        "",
    ]
    every = [
        [mode, run["prompt_tokens_computed"], run["wall_s"], run["tokens_per_s"]]
        for mode in MODES
        for run in result["runs"][mode]
    ]
    return lines + writer.table(["mode", "prompt tokens computed", "wall s", "tok/s"], every)


def main(argv: list[str]) -> int:
    p = options.parser("n", __doc__)
    p.add_argument("--rounds", type=int, default=3, help="rounds of one run per mode, order alternated")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    args = p.parse_args(argv)
    if args.quick:  # one round, 8 new tokens: a smoke run
        args.rounds, args.max_new_tokens = 1, 8
    run = writer.Run(options.command("n", argv))
    loaded = run.load(args)
    figures = asyncio.run(measure(args, loaded))
    writer.publish(run, args.out_dir, options.result_name(args, "n-completions"), TITLE, figures, section)
    return 0
