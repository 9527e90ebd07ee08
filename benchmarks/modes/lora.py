"""LoRA adapters' cost (issue 32): 32 closed-loop clients spread over 4 adapters of rank 16 against the same
workload on the base model alone, on the one server `python -m llmserve` starts (the default model, its engine
process, the fused CPU forward), in windows that alternate (L B, B L, ...) in one run so that the machine's drift
hits both alike.

The adapters are made at start with PEFT on the served model (rank 16, alpha 32, every target projection, both
factors random and scaled down so that the text stays finite), saved in a temporary folder and served with
`--lora NAME=PATH`. Client c asks adapter c mod 4 in the LoRA windows and the base model in the others; the prompts
(40 token ids each), the sampling and the token counts (EOS ignored) are the same. A window's throughput is the
completion tokens that arrived inside it over its length; time to first token is from the request's start to its
first token, for requests started inside the window. Then: the LoadAdapter RPC's wall time (an adapter of the same
size loaded and unloaded again, median of several), and the engine process's resident memory per adapter (four more
loaded: the RSS delta over four, from the server's metrics) beside the adapter's host bytes (AdapterInfo.host_bytes).

    python benchmarks/run.py --mode lora [--windows 3] [--window-s 30] [--clients 32] [--quick]

Writes benchmarks/results/<date>-cpu-lora.{md,json} (`make bench-lora`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import options, writer
from benchmarks.metrics import ratio
from benchmarks.serve import Server
from benchmarks.window import Window, ttft_summary, window_ratios
from llmserve_client import AsyncClient, Client

TITLE = "LoRA adapters: 32 clients over 4 rank-16 adapters vs the base model (issue 32)"
ADAPTERS = 4
PROMPT_TOKENS = 40  # about a chat-templated question's length
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_spec: str | None, root: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters of `rank` on every target of the served model, saved under `root`."""
    import torch
    from peft import LoraConfig, get_peft_model

    from llmserve.models.loader import load_model

    loaded = load_model(model_spec, device="cpu", dtype="float32")
    folders = []
    for i in range(count):
        torch.manual_seed(100 + i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        peft_model = get_peft_model(loaded.model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.01)  # random but small: the adapted model's text stays finite
        folder = root / f"adapter-{i}"
        peft_model.save_pretrained(str(folder))
        loaded.model = peft_model.unload()  # the base model again, for the next adapter
        folders.append(folder)
    return folders


def prompts(vocab_size: int, count: int = 8, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """Token-id prompts (the same in both modes; a random-weight model has no tokenizer)."""
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


async def client_loop(
    c: int, window: Window, address: str, adapter: str, args: argparse.Namespace, prompt_ids: list[list[int]]
) -> None:
    async with AsyncClient(address, timeout=600) as client:
        for k, prompt in window.calls(c, prompt_ids):
            await window.count(
                client.generate(
                    token_ids=prompt,
                    max_new_tokens=args.max_new_tokens,
                    ignore_eos=True,
                    temperature=0.7,
                    seed=c * 1000 + k,
                    return_token_ids=True,
                    adapter=adapter,
                )
            )


async def run_window(mode: str, address: str, args: argparse.Namespace, prompt_ids: list[list[int]]) -> Window:
    window = Window.starting_now(args.warmup_s, args.window_s)
    names = [f"a{c % ADAPTERS}" if mode == "lora" else "" for c in range(args.clients)]
    await asyncio.gather(*(client_loop(c, window, address, names[c], args, prompt_ids) for c in range(args.clients)))
    return window


def engine_rss(metrics_url: str) -> int:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("llmserve_engine_process_resident_memory_bytes "):
                return int(float(line.split()[1]))
    raise RuntimeError("the server reports no engine process memory")


def loads(address: str, metrics_url: str, spare: list[Path], repeats: int) -> dict[str, Any]:
    """LoadAdapter's wall time (load + unload, `repeats` times), and memory per adapter (len(spare) loaded)."""
    with Client(address, timeout=120) as client:
        times = []
        for r in range(repeats):
            t = time.perf_counter()
            info = client.load_adapter(f"timed-{r}", str(spare[0]))
            times.append((time.perf_counter() - t) * 1e3)
            client.unload_adapter(f"timed-{r}")
        time.sleep(1.0)
        before = engine_rss(metrics_url)
        for i, folder in enumerate(spare):
            client.load_adapter(f"extra-{i}", str(folder))
        time.sleep(1.0)
        after = engine_rss(metrics_url)
        for i in range(len(spare)):
            client.unload_adapter(f"extra-{i}")
    return {
        "load_ms": {"median": round(statistics.median(times), 1), "all": [round(t, 1) for t in times]},
        "host_bytes_per_adapter": info.host_bytes,
        "rss_bytes_per_adapter": round((after - before) / len(spare)),
        "adapter_files_bytes": sum(f.stat().st_size for f in spare[0].iterdir()),
    }


async def measure(address: str, args: argparse.Namespace) -> dict[str, Any]:
    async with AsyncClient(address, timeout=30) as client:
        info = await client.model_info()
    prompt_ids = prompts(info.vocab_size)
    rates: dict[str, list[float]] = {"lora": [], "base": []}
    ttfts: dict[str, list[float]] = {"lora": [], "base": []}
    for i in range(args.windows):
        for mode in ("lora", "base") if i % 2 == 0 else ("base", "lora"):
            window = await run_window(mode, address, args, prompt_ids)
            rates[mode].append(window.tokens_per_s)
            ttfts[mode] += window.ttfts
        print(json.dumps({k: [round(r, 1) for r in v] for k, v in rates.items()}), flush=True)
    ratios, median = window_ratios(rates["lora"], rates["base"])
    return {
        "served": {"model": info.name, "dtype": info.dtype, "device": info.device, "backend": info.backend},
        "clients": args.clients,
        "adapters": ADAPTERS,
        "rank": args.rank,
        "max_new_tokens": args.max_new_tokens,
        "window_s": args.window_s,
        "tokens_per_s": rates,
        "ratio_per_window_pair": ratios,
        "ratio_median": median,
        "ttft_s": {mode: ttft_summary(v) for mode, v in ttfts.items()},
    }


def main(argv: list[str]) -> int:
    p = options.parser("lora", __doc__)
    options.add_windows(p, "LoRA, base", window_s=30.0, warmup_s=8.0, max_new_tokens=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--load-repeats", type=int, default=5)
    args = options.parse_windows(p, argv)
    if args.quick:
        args.load_repeats = 2
    run = writer.Run(options.command("lora", argv))
    root = Path(tempfile.mkdtemp(prefix="llmserve-bench-lora-"))
    try:
        folders = make_adapters(args.model, root, 2 * ADAPTERS, args.rank)
        flags = [
            "--max-loras",
            str(ADAPTERS),
            "--max-lora-rank",
            str(args.rank),
            "--max-cpu-loras",
            str(2 * ADAPTERS + 1),
        ]
        for i, folder in enumerate(folders[:ADAPTERS]):
            flags += ["--lora", f"a{i}={folder}"]
        with Server(flags, model=args.model, device=args.device, dtype=args.dtype, metrics=True) as server:
            asyncio.run(server.wait_serving())
            figures = asyncio.run(measure(server.address, args))
            figures["loading"] = loads(server.address, server.metrics_url, folders[ADAPTERS:], args.load_repeats)
            run.model = figures.pop("served")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    writer.publish(run, args.out_dir, options.result_name(args, "lora"), TITLE, figures, section)
    return 0


def section(result: dict[str, Any]) -> list[str]:
    """The page's section, from the JSON."""
    rates, ttft, loading = result["tokens_per_s"], result["ttft_s"], result["loading"]
    served = (
        f"Served by `python -m llmserve` (engine process) with {result['adapters']} adapters of rank {result['rank']}",
        f"on every target projection (`--lora`); {result['clients']} closed-loop clients,",
        f"{result['max_new_tokens']} new tokens each (EOS ignored, sampled),",
        f"windows of {result['window_s']:g} s alternated (L B, B L, ...).",
    )
    lines = [" ".join(served), ""]
    pairs = zip(rates["lora"], rates["base"], strict=True)
    rows = [[i + 1, f"{lo:.1f}", f"{ba:.1f}", writer.num(ratio(lo, ba), 3)] for i, (lo, ba) in enumerate(pairs)]
    lines += writer.table(["window pair", "4 adapters tok/s", "base model tok/s", "ratio"], rows)
    lo, ba = ttft["lora"], ttft["base"]
    mib = 1 << 20
    figures = (
        f"Median ratio {result['ratio_median']} (target >= 0.8). Time to first token P50 / P99:",
        f"with adapters {lo['p50']} s / {lo['p99']} s ({lo['n']} requests),",
        f"base {ba['p50']} s / {ba['p99']} s ({ba['n']} requests).",
    )
    memory = (
        f"LoadAdapter (rank {result['rank']}, all targets): median {loading['load_ms']['median']} ms",
        f"over {len(loading['load_ms']['all'])} loads. Memory per adapter:",
        f"{loading['host_bytes_per_adapter'] / mib:.1f} MiB of factors (float32),",
        f"engine process RSS +{loading['rss_bytes_per_adapter'] / mib:.1f} MiB per adapter;",
        f"files {loading['adapter_files_bytes'] / mib:.1f} MiB.",
    )
    return [*lines, "", " ".join(figures), "", " ".join(memory)]
