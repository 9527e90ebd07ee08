"""The embed mode's last part (issue 44): generation streams alone vs with embedding traffic beside them, served by
one server, windows alternated (benchmarks/modes/embed.py's docstring says what each system sends).

The server is `python -m llmserve --pooling last` over the generative model (the default, SmolLM2; `--gen-model`):
decoder pooling, each Embed input a prefill-only sequence in the same continuous batch as the streams' decodes. A
model without a tokenizer (`random:*`, the smoke test's) gets token ids made from the sentences' characters instead
of the texts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from typing import Any

import torch

from benchmarks import alternation, memory, writer
from benchmarks.metrics import percentile
from benchmarks.serve import Server
from benchmarks.window import Window
from llmserve.models.loader import RANDOM_PREFIX
from llmserve_client import AsyncClient

SYSTEMS = ("generation alone", "generation + embeddings")
CPU = torch.device("cpu")
Prompt = str | list[int]


def add_options(p: argparse.ArgumentParser) -> None:
    """The part's options on the embed mode's parser."""
    p.add_argument("--mixed-windows", type=int, default=3, help="sets of windows of the mixed part (one per system)")
    p.add_argument("--gen-model", default=None, help="the mixed part's generative model (unset: the default)")
    p.add_argument("--gen-streams", type=int, default=32, help="closed-loop Generate streams")
    p.add_argument("--gen-max-new-tokens", type=int, default=64)
    p.add_argument("--mixed-embed-clients", type=int, default=8, help="callers sending one text per Embed call")
    p.add_argument(
        "--mixed-embed-rate",
        type=float,
        default=0.0,
        help="Embed calls per second of all callers together, each paced at its share; 0 (the default): closed "
        "loop, each calls again as soon as its answer arrives (issue 54: the scheduler's --pooling-share bounds "
        "what any embedding load takes of a step)",
    )
    p.add_argument("--gen-pooling", default="last", choices=("last", "mean"), help="the server's --pooling")
    p.add_argument(
        "--gen-pooling-step-tokens",
        type=int,
        default=None,
        help="the server's --pooling-step-tokens (unset: the server measures it at start; 63 was the fixed default)",
    )


def prompts(texts: list[str], model: str | None, vocab_size: int) -> list[Prompt]:
    """The sentences as prompts: texts, or for a model without a tokenizer token ids from their characters."""
    if model is None or not model.startswith(RANDOM_PREFIX):
        return list(texts)
    return [[3 + ord(ch) % (vocab_size - 3) for ch in text[:64]] for text in texts]


async def _stream(client: AsyncClient, window: Window, prompt: Prompt, seed: int, args: argparse.Namespace) -> None:
    source: dict[str, Any] = {"token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    await window.count(
        client.generate(
            **source,
            max_new_tokens=args.gen_max_new_tokens,
            ignore_eos=True,
            temperature=0.7,
            seed=seed,
            return_token_ids=True,
        )
    )


async def run_window(
    address: str, items: list[Prompt], embed_clients: int, args: argparse.Namespace
) -> tuple[Window, Window]:
    """One window: the streams, and `embed_clients` Embed callers beside them; (generation, embeddings)."""
    gen = Window.starting_now(args.warmup_s, args.window_s)
    emb = Window(gen.counted_from, gen.end)
    order = itertools.cycle(range(len(items)))

    async def streamer(c: int, client: AsyncClient) -> None:
        for k in itertools.count():
            if gen.over:
                return
            await _stream(client, gen, items[(c * 7 + k) % len(items)], c * 100_000 + k, args)

    async def embedder(c: int, client: AsyncClient) -> None:
        # Paced: call k is due at start + (c / callers + k) * interval; a caller behind schedule calls at once.
        interval = embed_clients / args.mixed_embed_rate if args.mixed_embed_rate > 0 else 0.0
        due = time.monotonic() + interval * c / max(1, embed_clients)
        while not emb.over:
            if interval:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                due += interval
            item = items[next(order)]
            began = emb.begin()
            response = await client.embed([item])
            emb.done(began, [(time.monotonic(), float(len(response.embeddings)))])

    async with AsyncClient(address, timeout=600) as client:
        await client.embed([items[0]])  # connected and warm before the clock starts
        tasks = [streamer(c, client) for c in range(args.gen_streams)]
        tasks += [embedder(c, client) for c in range(embed_clients)]
        await asyncio.gather(*tasks)
    return gen, emb


def _summary(gen: Window, emb: Window, peak: int | None) -> dict[str, Any]:
    def ms(values: list[float], q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(value, 4)

    return {
        "gen_tokens_per_s": round(gen.tokens_per_s, 2),
        "gen_ttft_p50_s": ms(gen.ttfts, 50),
        "gen_ttft_p99_s": ms(gen.ttfts, 99),
        "embeddings_per_s": round(emb.tokens_per_s, 2),
        "embed_calls": len(emb.ttfts),
        "embed_p50_s": ms(emb.ttfts, 50),
        "embed_p99_s": ms(emb.ttfts, 99),
        "peak_rss_bytes": peak,
    }


def measure(texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The part's figures: every window of both systems, their medians and the streams' ratio."""
    flags = ["--pooling", args.gen_pooling, "--max-concurrent-streams", str(max(256, 2 * args.gen_streams))]
    if args.gen_pooling_step_tokens is not None:
        flags += ["--pooling-step-tokens", str(args.gen_pooling_step_tokens)]
    with Server(flags, model=args.gen_model, device=args.device, dtype=args.dtype) as server:
        asyncio.run(server.wait_serving())

        async def vocab() -> int:
            async with AsyncClient(server.address, timeout=60) as client:
                return int((await client.model_info()).vocab_size)

        items = prompts(texts, args.gen_model, asyncio.run(vocab()))
        callers = {SYSTEMS[0]: 0, SYSTEMS[1]: args.mixed_embed_clients}

        def run(system: str) -> dict[str, Any]:
            (gen, emb), peak = memory.peak_of(
                server.pid, CPU, lambda: asyncio.run(run_window(server.address, items, callers[system], args))
            )
            return _summary(gen, emb, peak)

        # One window of both loads first, not counted: the prompts (and Embed's texts, which last-token pooling
        # reads from the prefix cache) are then cached in every counted window alike, not from the second one on.
        # A quick (smoke) run goes without it.
        warm = not getattr(args, "quick", False)
        if warm:
            print({"part": "mixed", "warm": SYSTEMS[1], **run(SYSTEMS[1])}, flush=True)
        runs = alternation.in_turn(SYSTEMS, args.mixed_windows, run, {"part": "mixed"})
    medians = alternation.medians(runs, list(runs[SYSTEMS[0]][0]))
    alone, beside = (medians[system]["gen_tokens_per_s"] for system in SYSTEMS)
    return {
        "model": args.gen_model or "default",
        "pooling": args.gen_pooling,
        "pooling_step_tokens": args.gen_pooling_step_tokens,
        "warm_window": warm,
        "gen_streams": args.gen_streams,
        "gen_max_new_tokens": args.gen_max_new_tokens,
        "embed_clients": args.mixed_embed_clients,
        "embed_rate": args.mixed_embed_rate,
        "windows": args.mixed_windows,
        "runs": runs,
        "median": medians,
        "gen_ratio": round(beside / alone, 3) if alone and beside is not None else None,
    }


def section(mixed: dict[str, Any]) -> list[str]:
    """The part's Markdown, from its JSON."""
    med = mixed["median"]
    rate = mixed.get("embed_rate", 0.0)
    pace = f"{rate:g} calls/s in all, paced" if rate else "closed loop"
    fixed = mixed.get("pooling_step_tokens")
    step_tokens = "measured at start" if fixed is None else f"{fixed}"
    warmed = (
        ", after one uncounted window of both loads (the prompts cached alike in every counted one)"
        if mixed.get("warm_window")
        else ""
    )
    lines = [
        "",
        "## Generation with embeddings beside it",
        "",
        f"One server: {mixed['model']} with `--pooling {mixed['pooling']}` (`--pooling-step-tokens` "
        f"{step_tokens}); {mixed['gen_streams']} closed-loop "
        f"Generate streams ({mixed['gen_max_new_tokens']} new tokens each), alone or with "
        f"{mixed['embed_clients']} Embed callers at one text per call beside them ({pace}); "
        f"{mixed['windows']} sets of one window per system, order alternated{warmed}. The streams' tokens/s with "
        f"embeddings beside them: **{writer.times(mixed['gen_ratio'])}** of alone (target >= 0.8x).",
        "",
    ]
    rows = [
        [
            system,
            writer.num(med[system]["gen_tokens_per_s"], 1),
            writer.seconds(med[system]["gen_ttft_p50_s"]),
            writer.seconds(med[system]["gen_ttft_p99_s"]),
            writer.num(med[system]["embeddings_per_s"], 1) if system != SYSTEMS[0] else "-",
            writer.seconds(med[system]["embed_p50_s"]),
            writer.seconds(med[system]["embed_p99_s"]),
            writer.mib(med[system]["peak_rss_bytes"]),
        ]
        for system in SYSTEMS
    ]
    header = ["system (median)", "gen tok/s", "TTFT p50", "TTFT p99", "emb/s", "Embed p50", "Embed p99", "peak RSS"]
    return lines + writer.table(header, rows)
