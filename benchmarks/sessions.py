"""Session KV reuse (issue 4), measured on the llmserve engine in-process.

(a) Long history: a conversation with about 2,000 tokens of history; time to first token of the next turn
    when its session is reused, against cold (an engine with reuse off: no session id, prefix caching off),
    median over a few conversations.
(b) Multi-turn chat: N concurrent sessions × T turns, each turn's prompt being the whole conversation so far
    plus a new user message; prefix hit rate (cached / prompt tokens), TTFT P50/P99 and throughput with reuse
    on (session ids, prefix caching on) and off, side by side in one run.
(c) Append mode (issue 15): the same N × T workload through gRPC, every turn resent in full vs only the new
    tokens with `continue_session`; request bytes per turn, TTFT P50/P99 (benchmarks/append_mode.py).

Conversations are built at the token level: the next turn's prompt is the previous prompt, the answer's
token ids and the template's tokens for "end of answer, next user message, generation prompt", so a reused
session matches up to the new message.

    python -m benchmarks.sessions [--quick] [--model SPEC] [--device cpu|cuda] [--parts long,multi,append]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from benchmarks import append_mode
from benchmarks.metrics import percentile
from benchmarks.paths import ROOT, child_env
from benchmarks.settings import BenchSettings, EngineSettings
from benchmarks.workload import PLACEHOLDER, chat_frame, word_ids
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.config import EngineConfig
from llmserve.engine.request import GenerationRequest, StoppingParams
from llmserve.models import LoadedModel, load_model

SECOND = "\x00SECOND\x00"


@dataclass(slots=True, frozen=True)
class SessionsSpec:
    """Sizes of both parts; lengths are in tokens."""

    history_tokens: int = 2000
    history_reps: int = 3
    sessions: int = 32
    turns: int = 6
    first_message: tuple[int, int] = (32, 96)
    follow_up: int = 32
    answer: int = 32
    seed: int = 0


FULL = SessionsSpec()
QUICK = SessionsSpec(history_tokens=300, history_reps=1, sessions=4, turns=3, first_message=(16, 32), answer=8)


@dataclass(slots=True)
class Turn:
    """One call's outcome."""

    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    output_ids: list[int]


class ChatBuilder:
    """Token-level chat turns of random words in the model's chat template (random ids without a tokenizer)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, seed: int) -> None:
        self.seed = seed
        self.open_prefix: list[int] = []
        self.open_suffix: list[int] = []
        self.next_prefix: list[int] = []
        self.next_suffix: list[int] = []
        if tokenizer is None:
            self.words = list(range(min(256, vocab_size // 2), vocab_size))
            return
        self.words = word_ids(tokenizer)
        self.open_prefix, self.open_suffix = chat_frame(tokenizer)
        if tokenizer.chat_template is not None:
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": PLACEHOLDER},
                {"role": "user", "content": SECOND},
            ]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            between, after = text.split(PLACEHOLDER)[1].split(SECOND)
            self.next_prefix = tokenizer.encode(between, add_special_tokens=False)
            self.next_suffix = tokenizer.encode(after, add_special_tokens=False)

    def _words(self, key: str, n: int) -> list[int]:
        return random.Random(f"{self.seed}/{key}").choices(self.words, k=max(1, n))

    def opening(self, key: str, n: int) -> list[int]:
        """A first user message of about n tokens, ready for the answer."""
        return self.open_prefix + self._words(key, n - len(self.open_prefix) - len(self.open_suffix)) + self.open_suffix

    def follow_up(self, key: str, n: int) -> list[int]:
        """Closes the answer, adds a user message of about n tokens and the generation prompt."""
        return self.next_prefix + self._words(key, n - len(self.next_prefix) - len(self.next_suffix)) + self.next_suffix

    def history(self, key: str, n: int) -> list[int]:
        """A multi-turn conversation of at least n tokens ending with the generation prompt."""
        ids = self.opening(f"{key}/0", 200)
        turn = 0
        while len(ids) < n:
            turn += 1
            ids += self._words(f"{key}/answer{turn}", 150) + self.follow_up(f"{key}/{turn}", 100)
        return ids


def sized_engine(engine: EngineSettings, spec: SessionsSpec) -> EngineSettings:
    """Room for every session's longest turn twice over (running plus retained), and for the long history."""
    longest = spec.first_message[1] + spec.turns * (spec.answer + spec.follow_up + 32)
    tokens = max(engine.kv_cache_tokens, 2 * spec.sessions * longest, 4 * (spec.history_tokens + 512))
    return replace(engine, kv_cache_tokens=tokens, max_num_seqs=max(engine.max_num_seqs, spec.sessions))


def engine_config(settings: BenchSettings, reuse: bool) -> EngineConfig:
    e = settings.engine
    return EngineConfig(
        block_size=e.block_size,
        kv_cache_tokens=e.kv_cache_tokens,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        enable_prefix_caching=reuse,
    )


async def call(engine: AsyncEngine, rid: str, prompt: list[int], new: int, session: str | None) -> Turn:
    """One greedy call generating exactly `new` tokens; returns its timings and token ids."""
    request = GenerationRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        stopping=StoppingParams(max_new_tokens=new, ignore_eos=True),
        session_id=session,
    )
    start = time.perf_counter()
    first = None
    ids: list[int] = []
    cached = 0
    async for delta in engine.generate(request):
        if delta.token_ids and first is None:
            first = time.perf_counter()
        ids += delta.token_ids
        if delta.usage is not None:
            cached = delta.usage.cached_prompt_tokens
        if delta.finished and delta.error:
            raise RuntimeError(f"{rid}: {delta.finish_reason.value}: {delta.error}")
    end = time.perf_counter()
    return Turn((first or end) - start, end - start, len(prompt), cached, ids)


async def with_engine(loaded: LoadedModel, config: EngineConfig, body):
    engine = AsyncEngine(loaded, config)
    await engine.start()
    try:
        return await body(engine)
    finally:
        await engine.shutdown()


async def long_history(loaded: LoadedModel, settings: BenchSettings, spec: SessionsSpec) -> dict:
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
        "speedup": cold_ttft / reuse_ttft if reuse_ttft else None,
    }


async def multi_turn(loaded: LoadedModel, settings: BenchSettings, spec: SessionsSpec, reuse: bool) -> dict:
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


PARTS = ("long", "multi", "append")


async def run_all(
    loaded: LoadedModel, settings: BenchSettings, spec: SessionsSpec, parts: tuple[str, ...] = PARTS
) -> dict:
    started = time.perf_counter()
    result: dict = {"spec": asdict(spec)}
    if "long" in parts:
        result["long_history"] = await long_history(loaded, settings, spec)
    if "multi" in parts:
        result["multi_turn"] = [
            await multi_turn(loaded, settings, spec, reuse=True),
            await multi_turn(loaded, settings, spec, reuse=False),
        ]
    if "append" in parts:
        chat = ChatBuilder(loaded.tokenizer, loaded.vocab_size, spec.seed)
        result["append_mode"] = await append_mode.append_vs_resend(loaded, engine_config(settings, True), spec, chat)
    result["wall_s"] = time.perf_counter() - started
    return result


def _s(v: float | None) -> str:
    return "–" if v is None else (f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s")


def to_markdown(result: dict) -> str:
    spec = result["spec"]
    lines = ["## Session reuse (issues 4 and 15)", ""]
    if "long_history" in result:
        a = result["long_history"]
        cached = sum(a["cached_prompt_tokens"]) / max(1, sum(a["prompt_tokens"]))
        speedup = "–" if a["speedup"] is None else f"{a['speedup']:.1f}×"
        mean_prompt = sum(a["prompt_tokens"]) / max(1, len(a["prompt_tokens"]))
        lines += [
            f"**Long history** ({a['conversations']} conversations of ~{spec['history_tokens']} tokens; next turn "
            f"{mean_prompt:.0f} tokens on average): TTFT median {_s(a['ttft_reuse_median_s'])} with the session "
            f"reused ({cached:.0%} of the prompt cached) vs {_s(a['ttft_cold_median_s'])} cold: **{speedup}** "
            "(target ≥ 9×).",
            "",
        ]
    lines += [
        f"**Multi-turn chat**: {spec['sessions']} concurrent sessions × {spec['turns']} turns, {spec['answer']} "
        f"new tokens per turn, follow-ups of ~{spec['follow_up']} tokens.",
        "",
    ]
    if "multi_turn" in result:
        lines += [
            "| reuse | hit rate | TTFT P50 / P99 (all turns) | TTFT P50 / P99 (turns 2+) | output tok/s | turns/s "
            "| wall |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in result["multi_turn"]:
            hit = "–" if m["hit_rate"] is None else f"{m['hit_rate']:.0%}"
            lines.append(
                f"| {'on' if m['reuse'] else 'off'} | {hit} | {_s(m['ttft_p50_s'])} / {_s(m['ttft_p99_s'])} "
                f"| {_s(m['ttft_p50_later_turns_s'])} / {_s(m['ttft_p99_later_turns_s'])} "
                f"| {m['output_tokens_per_s']:.1f} | {m['turns_per_s']:.2f} | {m['wall_s']:.0f} s |"
            )
        lines += ["", "Reuse off: an engine with prefix caching off and no session ids (in-process engine).", ""]
    if "append_mode" in result:
        lines += append_mode.to_markdown(result["append_mode"], spec, _s) + [""]
    lines.append(f"Whole section: {result['wall_s']:.0f} s.")
    return "\n".join(lines)


def run_isolated(settings: BenchSettings, work: Path, quick: bool) -> tuple[dict | None, str]:
    """Run the session benchmark in its own process (as run.py does for each system)."""
    settings_path, out_path = work / "sessions-settings.json", work / "sessions.json"
    settings_path.write_text(settings.to_json())
    cmd = [sys.executable, "-m", "benchmarks.sessions", "--settings", str(settings_path), "--out", str(out_path)]
    proc = subprocess.run(cmd + (["--quick"] if quick else []), cwd=ROOT, env=child_env())
    if proc.returncode != 0 or not out_path.exists():
        return None, f"## Session reuse (issue 4)\n\nFailed: the process exited with {proc.returncode}."
    result = json.loads(out_path.read_text())
    return result, to_markdown(result)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = argparse.ArgumentParser(prog="python -m benchmarks.sessions", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--settings", type=Path, help="BenchSettings JSON (from run.py)")
    p.add_argument("--out", type=Path, help="write the JSON result here; default: a results file")
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma-separated subset of long (a), multi (b), append (c); default all",
    )
    args = p.parse_args(argv)
    parts = tuple(args.parts.split(","))
    if not parts or not set(parts) <= set(PARTS):
        p.error(f"--parts: a comma-separated subset of {','.join(PARTS)}")
    if args.settings:
        settings = BenchSettings.from_json(args.settings.read_text())
    else:
        settings = BenchSettings(model=args.model, device=args.device, dtype=args.dtype)
    spec = QUICK if args.quick else FULL
    settings = replace(settings, engine=sized_engine(settings.engine, spec))
    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype)
    result = asyncio.run(run_all(loaded, settings, spec, parts))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        return 0
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{datetime.date.today().isoformat()}-{loaded.device.type}-sessions"
    if parts != PARTS:
        name += "-" + "-".join(parts)
    name += "-quick" if args.quick else ""
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{name}.md").write_text(to_markdown(result) + "\n")
    print(f"wrote {out_dir / name}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
