"""Append mode (issue 15): the multi-turn workload through gRPC, full resend vs append mode.

Both modes run the same N sessions × T turns (all sessions at once, each one's turns one after another) against
an llmserve server started in this process on a loopback port, with session ids and prefix caching on:
- resend: every turn sends the whole conversation so far as token ids (the stateless caller);
- append: the first turn is sent whole, every later one only its new tokens with `continue_session`, and the
  server prepends the session's history.
The prompts the model reads are the same in both modes, so the (greedy) outputs must be too; the run checks it.
Measured per mode: request bytes per turn (the serialized GenerateRequest, what the caller sends), TTFT P50/P99
seen by the client, hit rate and throughput. Also part (c) of the sessions mode.

    python benchmarks/run.py --mode append [--quick]
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, replace
from typing import Any

from benchmarks import options, writer
from benchmarks.chat import FULL, QUICK, ChatBuilder, SessionsSpec, engine_config, sized_engine
from benchmarks.metrics import percentile
from benchmarks.settings import BenchSettings
from benchmarks.writer import seconds
from llmserve.app import LLMServer
from llmserve.config import ServerConfig
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve_client import AsyncClient, build_request

TITLE = "Append mode vs full resend, through gRPC (issue 15)"


async def _serve(loaded: LoadedModel, config: EngineConfig, streams: int) -> LLMServer:
    server = LLMServer(ServerConfig(address="127.0.0.1:0", max_concurrent_streams=streams, reflection=False))
    await server.start()
    await server.serve(AsyncEngine(loaded, config))
    return server


async def run_mode(
    loaded: LoadedModel, config: EngineConfig, spec: SessionsSpec, chat: ChatBuilder, append: bool
) -> tuple[dict[str, Any], list[list[list[int]]]]:
    """One mode's run: its figures, and every session's output ids per turn."""
    server = await _serve(loaded, config, max(256, 2 * spec.sessions))
    client = AsyncClient(f"127.0.0.1:{server.port}")
    rows: list[list[dict[str, Any]]] = [[] for _ in range(spec.sessions)]
    outputs: list[list[list[int]]] = [[] for _ in range(spec.sessions)]

    async def session(s: int) -> None:
        sid = f"chat{s}"
        lo, hi = spec.first_message
        prompt = chat.opening(sid, random.Random(f"{spec.seed}/{sid}").randint(lo, hi))
        new = prompt
        for t in range(spec.turns):
            continues = append and t > 0
            request = build_request(
                token_ids=new if continues else prompt,
                session_id=sid,
                continue_session=continues,
                max_new_tokens=spec.answer,
                ignore_eos=True,
                return_token_ids=True,
            )
            start = time.perf_counter()
            first = None
            ids: list[int] = []
            async for response in client.generate(request):
                if response.token_ids and first is None:
                    first = time.perf_counter()
                ids += response.token_ids
                last = response
            end = time.perf_counter()
            rows[s].append(
                {
                    "bytes": request.ByteSize(),
                    "ttft_s": (first or end) - start,
                    "engine_ttft_s": last.timing.time_to_first_token_seconds,
                    "prompt_tokens": last.usage.prompt_tokens,
                    "cached_prompt_tokens": last.usage.cached_prompt_tokens,
                    "output_tokens": len(ids),
                }
            )
            outputs[s].append(ids)
            new = chat.follow_up(f"{sid}/{t}", spec.follow_up)
            prompt = prompt + ids + new

    try:
        start = time.perf_counter()
        await asyncio.gather(*(session(s) for s in range(spec.sessions)))
        wall = time.perf_counter() - start
    finally:
        await client.close()
        await server.stop(0)
    return summarize(rows, wall, append, spec), outputs


def summarize(rows: list[list[dict[str, Any]]], wall: float, append: bool, spec: SessionsSpec) -> dict[str, Any]:
    flat = [r for session in rows for r in session]
    later = [r for session in rows for r in session[1:]]
    prompt_tokens = sum(r["prompt_tokens"] for r in flat)
    cached = sum(r["cached_prompt_tokens"] for r in flat)
    by_turn = [[session[t] for session in rows] for t in range(spec.turns)]
    return {
        "mode": "append" if append else "resend",
        "sessions": spec.sessions,
        "turns": spec.turns,
        "wall_s": wall,
        "bytes_per_turn": [sum(r["bytes"] for r in turn) / len(turn) for turn in by_turn],
        "bytes_total": sum(r["bytes"] for r in flat),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else None,
        "ttft_p50_s": percentile([r["ttft_s"] for r in flat], 50),
        "ttft_p99_s": percentile([r["ttft_s"] for r in flat], 99),
        "ttft_p50_later_turns_s": percentile([r["ttft_s"] for r in later], 50),
        "ttft_p99_later_turns_s": percentile([r["ttft_s"] for r in later], 99),
        # What the engine measured from the request's arrival: the rest of the client's TTFT is the service's
        # and the channel's (tokenizing, the history, gRPC, two event loops on one machine).
        "engine_ttft_p50_s": percentile([r["engine_ttft_s"] for r in flat], 50),
        "outside_engine_ttft_p50_s": percentile([r["ttft_s"] - r["engine_ttft_s"] for r in flat], 50),
        "output_tokens_per_s": sum(r["output_tokens"] for r in flat) / wall,
    }


async def append_vs_resend(
    loaded: LoadedModel, config: EngineConfig, spec: SessionsSpec, chat: ChatBuilder
) -> dict[str, Any]:
    """Both modes, resend first, on fresh servers; and whether their outputs agree token for token."""
    resend, resend_out = await run_mode(loaded, config, spec, chat, append=False)
    append, append_out = await run_mode(loaded, config, spec, chat, append=True)
    return {"modes": [resend, append], "same_outputs": resend_out == append_out}


def comparison(result: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """Both modes side by side, from the JSON (the sessions mode's part (c) too)."""
    resend, append = result["modes"]
    turns = range(1, spec["turns"] + 1)
    lines = [
        f"**Append mode vs full resend, through gRPC** (issue 15): the same {spec['sessions']} sessions × "
        f"{spec['turns']} turns, session ids and prefix caching on in both; outputs identical token for token: "
        f"**{'yes' if result['same_outputs'] else 'NO'}**.",
        "",
    ]
    header = ["mode", "request bytes, all turns", "TTFT P50 / P99 (all turns)", "TTFT P50 / P99 (turns 2+)"]
    header += ["engine TTFT P50", "outside the engine P50", "hit rate", "output tok/s", "wall"]
    rows = [
        [
            m["mode"],
            f"{m['bytes_total']:,}",
            f"{seconds(m['ttft_p50_s'])} / {seconds(m['ttft_p99_s'])}",
            f"{seconds(m['ttft_p50_later_turns_s'])} / {seconds(m['ttft_p99_later_turns_s'])}",
            seconds(m["engine_ttft_p50_s"]),
            seconds(m["outside_engine_ttft_p50_s"]),
            writer.pct(m["hit_rate"]),
            f"{m['output_tokens_per_s']:.1f}",
            f"{m['wall_s']:.0f} s",
        ]
        for m in (resend, append)
    ]
    lines += writer.table(header, rows) + ["", "Mean request bytes per turn:", ""]
    per_turn = [[m["mode"], *(f"{b:,.0f}" for b in m["bytes_per_turn"])] for m in (resend, append)]
    return lines + writer.table(["mode", *(f"turn {t}" for t in turns)], per_turn)


def main(argv: list[str]) -> int:
    args = options.parser("append", __doc__).parse_args(argv)
    run = writer.Run(options.command("append", argv))
    spec = QUICK if args.quick else FULL
    settings = BenchSettings(model=args.model, device=args.device, dtype=args.dtype)
    config = engine_config(replace(settings, engine=sized_engine(settings.engine, spec)), reuse=True)
    loaded = run.load(args)
    chat = ChatBuilder(loaded.tokenizer, loaded.vocab_size, spec.seed)
    figures = {"spec": asdict(spec), "append_mode": asyncio.run(append_vs_resend(loaded, config, spec, chat))}
    name = options.result_name(args, "sessions-append")
    writer.publish(run, args.out_dir, name, TITLE, figures, lambda d: comparison(d["append_mode"], d["spec"]))
    return 0
