"""KV tiers (issue 24): returning conversations over a pool that holds only a few of them, disk tier vs recompute.

(a) Many conversations: S sessions x T turns, each opening with a history of ~H tokens, served round-robin one
    call at a time (turn t of every session, then turn t+1), so that each session's KV has left the pool by
    the time it returns. TTFT P50/P99 of the returning turns, wall time, output throughput and the disk tier's
    bytes written and read; with the disk tier (`--kv-offload-dir`) and without (the returning turn recomputes
    its history), in alternated rounds (A B, then B A, ...) in this process on the same model, so that the
    machine's drift cancels; the speed-up is the median of the rounds' P50 ratios.
(b) Restart: one conversation's first turn on an engine with the disk tier, the engine shut down (which writes
    what the pool still holds), a new engine on the same folder serving the second turn; its TTFT against the
    same turn recomputed.

On the CPU backend the disk tier is the tier that pays: host memory is where the pool itself lives.

    python benchmarks/run.py --mode kv-tiers [--quick] [--sessions S] [--turns T] [--history H] [--rounds R]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import options, writer
from benchmarks.chat import ChatBuilder, Turn, call
from benchmarks.metrics import percentile
from benchmarks.writer import seconds
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel


@dataclass(slots=True, frozen=True)
class TiersSpec:
    sessions: int = 16
    turns: int = 4
    history_tokens: int = 1500
    answer: int = 8
    follow_up: int = 32
    pool_conversations: int = 3  # the pool holds about this many conversations' KV
    block_size: int = 16
    seed: int = 0


QUICK = TiersSpec(sessions=4, turns=2, history_tokens=300, pool_conversations=2)


def config(spec: TiersSpec, disk_dir: str | None) -> EngineConfig:
    longest = spec.history_tokens + spec.turns * (spec.answer + spec.follow_up) + 256
    return EngineConfig(
        block_size=spec.block_size,
        kv_cache_tokens=spec.pool_conversations * longest,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        kv_offload_dir=disk_dir,
        kv_offload_disk_bytes=16 << 30,
    )


def tier_bytes(engine: AsyncEngine) -> dict:
    tiers = engine.core.engine_core.tiers
    if tiers is None:
        return {}
    disk = tiers.stats().tiers["disk"]
    return {
        "written_bytes": disk.stored_bytes,
        "read_bytes": disk.loaded_bytes,
        "written_blocks": disk.stored_blocks,
        "read_blocks": disk.loaded_blocks,
        "failed_loads": disk.failed_loads,
        "failed_stores": disk.failed_stores,
    }


async def conversations(loaded: LoadedModel, spec: TiersSpec, disk_dir: str | None, round_: int = 0) -> dict:
    chat = ChatBuilder(loaded.tokenizer, loaded.vocab_size, spec.seed + round_)
    prompts = [chat.history(f"conv{s}", spec.history_tokens) for s in range(spec.sessions)]
    returning: list[Turn] = []
    engine = AsyncEngine(loaded, config(spec, disk_dir))
    await engine.start()
    start = time.perf_counter()
    output = 0
    try:
        for t in range(spec.turns):
            for s in range(spec.sessions):
                turn = await call(engine, f"c{s}-{t}-{disk_dir is not None}", prompts[s], spec.answer, f"conv{s}")
                output += len(turn.output_ids)
                if t > 0:
                    returning.append(turn)
                prompts[s] = prompts[s] + turn.output_ids + chat.follow_up(f"conv{s}/{t}", spec.follow_up)
        wall = time.perf_counter() - start
    finally:
        await engine.shutdown()
    prompt_tokens = sum(t.prompt_tokens for t in returning)
    return {
        "mode": "disk tier" if disk_dir else "recompute",
        "round": round_,
        "returning_turns": len(returning),
        "mean_returning_prompt_tokens": sum(t.prompt_tokens for t in returning) / max(1, len(returning)),
        "cached_share": sum(t.cached_prompt_tokens for t in returning) / max(1, prompt_tokens),
        "ttft_p50_s": percentile([t.ttft_s for t in returning], 50),
        "ttft_p99_s": percentile([t.ttft_s for t in returning], 99),
        "wall_s": wall,
        "output_tokens_per_s": output / wall,
        **tier_bytes(engine),
    }


async def restart(loaded: LoadedModel, spec: TiersSpec, disk_dir: str) -> dict:
    chat = ChatBuilder(loaded.tokenizer, loaded.vocab_size, spec.seed + 1)
    prompt = chat.history("restart", spec.history_tokens + 500)
    first_engine = AsyncEngine(loaded, config(spec, disk_dir))
    await first_engine.start()
    try:
        first = await call(first_engine, "restart-1", prompt, spec.answer, "r")
    finally:
        await first_engine.shutdown()
    prompt = prompt + first.output_ids + chat.follow_up("restart/1", spec.follow_up)
    out = {"prompt_tokens": len(prompt)}
    for name, folder in (("after_restart", disk_dir), ("recompute", None)):
        engine = AsyncEngine(loaded, config(spec, folder))
        await engine.start()
        try:
            turn = await call(engine, f"restart-2-{name}", prompt, spec.answer, "r")
        finally:
            await engine.shutdown()
        out[f"ttft_{name}_s"] = turn.ttft_s
        out[f"cached_{name}"] = turn.cached_prompt_tokens
    return out


async def run_all(loaded: LoadedModel, spec: TiersSpec, rounds: int = 2) -> dict:
    started = time.perf_counter()
    modes: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="llmserve-kv-") as folder:
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)  # A B, then B A
            for with_disk in order:
                disk_dir = str(Path(folder) / f"conv{r}") if with_disk else None
                modes.append(await conversations(loaded, spec, disk_dir, r))
        again = await restart(loaded, spec, str(Path(folder) / "restart"))
    return {"spec": asdict(spec), "modes": modes, "restart": again, "wall_s": time.perf_counter() - started}


TITLE = "KV tiers (issue 24): disk tier vs recompute"


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    spec, modes, r = result["spec"], result["modes"], result["restart"]
    disk = next(m for m in modes if m["mode"] == "disk tier")
    ratios = []
    for round_ in sorted({m.get("round", 0) for m in modes}):
        pair = {m["mode"]: m for m in modes if m.get("round", 0) == round_}
        if pair["disk tier"]["ttft_p50_s"]:
            ratios.append(pair["recompute"]["ttft_p50_s"] / pair["disk tier"]["ttft_p50_s"])
    speedup = statistics.median(ratios) if ratios else float("nan")
    lines = [
        f"{spec['sessions']} sessions x {spec['turns']} turns, histories of ~{spec['history_tokens']} tokens, "
        f"served round-robin one call at a time over a pool of about {spec['pool_conversations']} conversations; "
        f"{spec['answer']} new tokens per turn. Returning turns: {disk['returning_turns']} "
        f"(~{disk['mean_returning_prompt_tokens']:.0f} prompt tokens).",
        "",
    ]
    header = ["round", "mode", "cached share", "TTFT P50", "TTFT P99", "wall", "output tok/s"]
    rows = [
        [
            m.get("round", 0),
            m["mode"],
            f"{m['cached_share']:.0%}",
            seconds(m["ttft_p50_s"]),
            seconds(m["ttft_p99_s"]),
            f"{m['wall_s']:.0f} s",
            f"{m['output_tokens_per_s']:.1f}",
            writer.mib(m.get("written_bytes")),
            writer.mib(m.get("read_bytes")),
        ]
        for m in modes
    ]
    lines += writer.table([*header, "disk written", "disk read"], rows)
    lines += [
        "",
        f"TTFT P50 of returning turns: **{speedup:.1f}x lower** with the disk tier (target >= 5x; median of the "
        f"rounds' ratios {', '.join(f'{x:.1f}' for x in ratios)}).",
        "",
        f"**Restart**: a {r['prompt_tokens']}-token returning turn on a new engine over the same folder: TTFT "
        f"{seconds(r['ttft_after_restart_s'])} ({r['cached_after_restart']} tokens reloaded from disk) vs "
        f"{seconds(r['ttft_recompute_s'])} recomputed.",
        "",
        f"Whole run: {result['wall_s']:.0f} s.",
    ]
    return lines


def main(argv: list[str]) -> int:
    p = options.parser("kv-tiers", __doc__)
    p.add_argument("--sessions", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--history", type=int, help="tokens of history each conversation opens with")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of both modes (A B, B A, ...)")
    args = p.parse_args(argv)
    run = writer.Run(options.command("kv-tiers", argv))
    spec = QUICK if args.quick else TiersSpec()
    overrides = {"sessions": args.sessions, "turns": args.turns, "history_tokens": args.history}
    spec = replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    loaded = run.load(args)
    figures = asyncio.run(run_all(loaded, spec, args.rounds))
    writer.publish(run, args.out_dir, options.result_name(args, "kv-tiers"), TITLE, figures, section)
    return 0
