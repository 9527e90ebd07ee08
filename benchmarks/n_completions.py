"""n completions from one prompt (issue 22): one request with n = 4 vs four separate requests, on the llmserve engine
in-process with the default model.

Each round sends a fresh ~1,000-token prompt (a new one every run, so no run finds another's prompt in the prefix
cache) and generates `--max-new-tokens` sampled tokens per completion (EOS ignored): once as one request with n = 4,
once as four requests with the same prompt and the derived seeds, sent together. Rounds alternate the order (A B,
B A, ...), so that the machine's drift hits both alike. Per run: prompt tokens the engine computed (counted on the
scheduler's plans, and from usage as prompt minus cached), wall time until all four finished, generated tokens per
second over that wall time, and the time to the last of the four first tokens.

    python -m benchmarks.n_completions [--rounds 3] [--prompt-tokens 1000] [--max-new-tokens 32] [--quick]
    python benchmarks/run.py --n-completions [--quick]        # the same, as a mode of `make bench`

Writes benchmarks/results/<date>-cpu-n-completions.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.paths import ROOT, make_importable  # noqa: E402

make_importable()

from llmserve.process import configure_process  # noqa: E402

configure_process()

from llmserve.engine.async_engine import AsyncEngine  # noqa: E402
from llmserve.engine.config import EngineConfig  # noqa: E402
from llmserve.engine.fanout import derive_seed  # noqa: E402
from llmserve.engine.request import GenerationRequest, SamplingParams, StoppingParams  # noqa: E402
from llmserve.models import load_model  # noqa: E402

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


def fresh_prompt(tok: Any, length: int, rng: random.Random) -> tuple[int, ...]:
    """A prompt of exactly `length` tokens that no earlier run sent (random words, cut to length)."""
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


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(None, device="cpu", dtype="float32")
    engine = AsyncEngine(loaded, EngineConfig(kv_cache_tokens=32768, max_num_seqs=16, cuda_graphs=False))
    await engine.start()
    counter = PromptCounter(engine)
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            prompt = fresh_prompt(loaded.tokenizer, args.prompt_tokens, rng)
            runs[mode].append(await one_run(engine, counter, mode, prompt, 1000 + r, args))
            print(json.dumps({"round": r, "mode": mode, **runs[mode][-1]}), flush=True)
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
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def write(result: dict[str, Any], command: str) -> Path:
    stamp = datetime.date.today().isoformat()
    out = ROOT / "benchmarks" / "results" / f"{stamp}-cpu-n-completions"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    med = result["median"]
    lines = [
        "# n = 4 completions vs four separate calls (benchmarks/n_completions.py)",
        "",
        f"`{command}`: SmolLM2-135M float32 on the CPU, a fresh {result['prompt_tokens']}-token prompt per run, "
        f"{result['max_new_tokens']} sampled tokens per completion, {result['rounds']} rounds in alternated order. "
        f"Load average after: {', '.join(f'{x:.1f}' for x in result['loadavg_after'])} (on a 2-core machine the "
        "times move with other work on it; the prompt token counts do not).",
        "",
        "| mode (median of rounds) | prompt tokens computed | (from usage) | wall s | tok/s | last first token s |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        m = med[mode]
        lines.append(
            f"| {mode} | {m['prompt_tokens_computed']:.0f} | {m['prompt_tokens_computed_by_usage']:.0f} | "
            f"{m['wall_s']:.2f} | {m['tokens_per_s']:.1f} | {m['last_first_token_s']:.2f} |"
        )
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
    ]
    lines += ["Every run:", "", "| mode | prompt tokens computed | wall s | tok/s |", "|---|---|---|---|"]
    for mode in MODES:
        for run in result["runs"][mode]:
            lines.append(f"| {mode} | {run['prompt_tokens_computed']} | {run['wall_s']} | {run['tokens_per_s']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out.with_suffix(".md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one run per mode, order alternated")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="prompt seed")
    parser.add_argument("--quick", action="store_true", help="one round, 8 new tokens: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_new_tokens = 1, 8
    return args


def rewrite(json_path: Path, command: str) -> None:
    """Write the markdown again from a run's JSON (no new measurement)."""
    write(json.loads(json_path.read_text()), command)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m benchmarks.n_completions " + " ".join(argv if argv is not None else sys.argv[1:])
    result = asyncio.run(main_async(args))
    write(result, command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
