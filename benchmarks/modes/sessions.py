"""Session KV reuse (issues 4 and 15), on the llmserve engine in-process.

(a) long: a conversation with about 2,000 tokens of history; time to first token of the next turn when its
    session is reused, against cold (an engine with reuse off: no session id, prefix caching off), median over
    a few conversations.
(b) multi: N concurrent sessions × T turns, each turn's prompt being the whole conversation so far plus a new
    user message; prefix hit rate (cached / prompt tokens), TTFT P50/P99 and throughput with reuse on (session
    ids, prefix caching on) and off, side by side in one run.
(c) append: the same N × T workload through gRPC, every turn resent in full vs only the new tokens with
    `continue_session` (the append mode, benchmarks/modes/append.py).

    python benchmarks/run.py --mode sessions [--quick] [--parts long,multi,append]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks import options, writer
from benchmarks.chat import FULL, QUICK, ChatBuilder, SessionsSpec, Turn, call, engine_config, sized_engine, with_engine
from benchmarks.metrics import percentile
from benchmarks.modes import append
from benchmarks.paths import ROOT, child_env
from benchmarks.settings import BenchSettings
from benchmarks.writer import seconds
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve.models.loader import load_model

TITLE = "Session reuse (issues 4 and 15)"
PARTS = ("long", "multi", "append")


async def long_history(loaded: LoadedModel, settings: BenchSettings, spec: SessionsSpec) -> dict[str, Any]:
    """Part (a): reuse TTFT on the reuse engine, then the same prompts cold on the engine with reuse off."""
    chat = ChatBuilder(loaded.tokenizer, loaded.vocab_size, spec.seed)
    prompts: list[list[int]] = []
    reuse: list[Turn] = []

    async def warm(engine: AsyncEngine) -> None:
        for i in range(spec.history_reps):
            history = chat.history(f"long{i}", spec.history_tokens)
            first = await call(engine, f"long{i}-t1", history, spec.answer, f"long{i}")
            prompt = history + first.output_ids + chat.follow_up(f"long{i}/next", spec.follow_up)
            prompts.append(prompt)
            reuse.append(await call(engine, f"long{i}-t2", prompt, 8, f"long{i}"))

    async def cold(engine: AsyncEngine) -> list[Turn]:
        return [await call(engine, f"cold{i}", p, 8, None) for i, p in enumerate(prompts)]

    await with_engine(loaded, engine_config(settings, True), warm)
    colds = await with_engine(loaded, engine_config(settings, False), cold)
    reuse_ttft = percentile([t.ttft_s for t in reuse], 50)
    cold_ttft = percentile([t.ttft_s for t in colds], 50)
    return {
        "conversations": spec.history_reps,
        "prompt_tokens": [len(p) for p in prompts],
        "cached_prompt_tokens": [t.cached_prompt_tokens for t in reuse],
        "ttft_reuse_s": [t.ttft_s for t in reuse],
        "ttft_cold_s": [t.ttft_s for t in colds],
        "ttft_reuse_median_s": reuse_ttft,
        "ttft_cold_median_s": cold_ttft,
        "speedup": cold_ttft / reuse_ttft if reuse_ttft and cold_ttft else None,
    }


async def multi_turn(loaded: LoadedModel, settings: BenchSettings, spec: SessionsSpec, reuse: bool) -> dict[str, Any]:
    """Part (b): every session runs its turns one after another; all sessions run at once."""
    chat = ChatBuilder(loaded.tokenizer, loaded.vocab_size, spec.seed)
    turns: list[list[Turn]] = [[] for _ in range(spec.sessions)]

    async def session(engine: AsyncEngine, s: int) -> None:
        lo, hi = spec.first_message
        prompt = chat.opening(f"chat{s}", random.Random(f"{spec.seed}/chat{s}").randint(lo, hi))
        for t in range(spec.turns):
            turn = await call(engine, f"chat{s}-{t}-{reuse}", prompt, spec.answer, f"chat{s}" if reuse else None)
            turns[s].append(turn)
            prompt = prompt + turn.output_ids + chat.follow_up(f"chat{s}/{t}", spec.follow_up)

    async def body(engine: AsyncEngine) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(session(engine, s) for s in range(spec.sessions)))
        return time.perf_counter() - start

    wall = await with_engine(loaded, engine_config(settings, reuse), body)
    flat = [t for ts in turns for t in ts]
    later = [t for ts in turns for t in ts[1:]]
    prompt_tokens = sum(t.prompt_tokens for t in flat)
    cached = sum(t.cached_prompt_tokens for t in flat)
    return {
        "reuse": reuse,
        "sessions": spec.sessions,
        "turns": spec.turns,
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else None,
        "ttft_p50_s": percentile([t.ttft_s for t in flat], 50),
        "ttft_p99_s": percentile([t.ttft_s for t in flat], 99),
        "ttft_p50_later_turns_s": percentile([t.ttft_s for t in later], 50),
        "ttft_p99_later_turns_s": percentile([t.ttft_s for t in later], 99),
        "output_tokens_per_s": sum(len(t.output_ids) for t in flat) / wall,
        "turns_per_s": len(flat) / wall,
    }


async def run_all(
    loaded: LoadedModel, settings: BenchSettings, spec: SessionsSpec, parts: tuple[str, ...] = PARTS
) -> dict[str, Any]:
    started = time.perf_counter()
    result: dict[str, Any] = {"spec": asdict(spec)}
    if "long" in parts:
        result["long_history"] = await long_history(loaded, settings, spec)
    if "multi" in parts:
        result["multi_turn"] = [
            await multi_turn(loaded, settings, spec, reuse=True),
            await multi_turn(loaded, settings, spec, reuse=False),
        ]
    if "append" in parts:
        chat = ChatBuilder(loaded.tokenizer, loaded.vocab_size, spec.seed)
        result["append_mode"] = await append.append_vs_resend(loaded, engine_config(settings, True), spec, chat)
    result["wall_s"] = time.perf_counter() - started
    return result


def section(result: dict[str, Any]) -> list[str]:
    """The page's section (also the ladder's, with --sessions), from the JSON."""
    spec = result["spec"]
    lines = [f"## {TITLE}", ""]
    if "long_history" in result:
        a = result["long_history"]
        cached = sum(a["cached_prompt_tokens"]) / max(1, sum(a["prompt_tokens"]))
        speedup = writer.times(a["speedup"])
        mean_prompt = sum(a["prompt_tokens"]) / max(1, len(a["prompt_tokens"]))
        lines += [
            f"**Long history** ({a['conversations']} conversations of ~{spec['history_tokens']} tokens; next turn "
            f"{mean_prompt:.0f} tokens on average): TTFT median {seconds(a['ttft_reuse_median_s'])} with the session "
            f"reused ({cached:.0%} of the prompt cached) vs {seconds(a['ttft_cold_median_s'])} cold: **{speedup}** "
            "(target ≥ 9×).",
            "",
        ]
    if "multi_turn" in result:
        lines += [
            f"**Multi-turn chat**: {spec['sessions']} concurrent sessions × {spec['turns']} turns, {spec['answer']} "
            f"new tokens per turn, follow-ups of ~{spec['follow_up']} tokens.",
            "",
        ]
        rows = [
            [
                "on" if m["reuse"] else "off",
                writer.pct(m["hit_rate"]),
                f"{seconds(m['ttft_p50_s'])} / {seconds(m['ttft_p99_s'])}",
                f"{seconds(m['ttft_p50_later_turns_s'])} / {seconds(m['ttft_p99_later_turns_s'])}",
                f"{m['output_tokens_per_s']:.1f}",
                f"{m['turns_per_s']:.2f}",
                f"{m['wall_s']:.0f} s",
            ]
            for m in result["multi_turn"]
        ]
        header = ["reuse", "hit rate", "TTFT P50 / P99 (all turns)", "TTFT P50 / P99 (turns 2+)", "output tok/s"]
        lines += writer.table([*header, "turns/s", "wall"], rows)
        lines += ["", "Reuse off: an engine with prefix caching off and no session ids (in-process engine).", ""]
    if "append_mode" in result:
        lines += append.comparison(result["append_mode"], spec) + [""]
    lines.append(f"Whole section: {result['wall_s']:.0f} s.")
    return lines


def add_arguments(p: argparse.ArgumentParser, parts: str = ",".join(PARTS)) -> None:
    p.add_argument("--parts", default=parts, help=f"comma-separated subset of {','.join(PARTS)}; default {parts}")
    p.add_argument("--settings", type=Path, help=argparse.SUPPRESS)  # BenchSettings JSON, from the ladder


def measure(args: argparse.Namespace, parts: tuple[str, ...], run: writer.Run) -> dict[str, Any]:
    """The parts asked for, on the model (and engine sizes) of `args`."""
    if args.settings:
        settings = BenchSettings.from_json(args.settings.read_text())
    else:
        settings = BenchSettings(model=args.model, device=args.device, dtype=args.dtype)
    spec = QUICK if args.quick else FULL
    settings = replace(settings, engine=sized_engine(settings.engine, spec))
    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype)
    run.measured_on(loaded)
    return asyncio.run(run_all(loaded, settings, spec, parts))


def main(argv: list[str]) -> int:
    p = options.parser("sessions", __doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    parts = tuple(args.parts.split(","))
    if not parts or not set(parts) <= set(PARTS):
        p.error(f"--parts: a comma-separated subset of {','.join(PARTS)}")
    run = writer.Run(options.command("sessions", argv))
    figures = measure(args, parts, run)
    stem = "sessions" + ("" if parts == PARTS else "-" + "-".join(parts))
    writer.publish(run, args.out_dir, options.result_name(args, stem), TITLE, figures, section)
    return 0


def run_isolated(settings: BenchSettings, work: Path, quick: bool) -> tuple[dict[str, Any] | None, str]:
    """The whole sessions mode in a process of its own (as the ladder runs each system): its JSON and section."""
    settings_path = work / "sessions-settings.json"
    settings_path.write_text(settings.to_json())
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--mode", "sessions", "--settings", str(settings_path)]
    cmd += ["--out-dir", str(work), "--name", "sessions", *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env())
    out = work / "sessions.json"
    if proc.returncode != 0 or not out.exists():
        return None, f"## {TITLE}\n\nFailed: the process exited with {proc.returncode}."
    result = json.loads(out.read_text())
    return result, "\n".join(section(result))
