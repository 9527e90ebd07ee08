"""Issue 12's GPU figures in one run: nano-vllm's workload in-process and over gRPC, decode step times with the
GPU's idle share, per random-weight shape; written as benchmarks/results/latest-gpu.json's summary.

    python benchmarks/run.py --mode gpu-perf --out DIR                        # on the GPU: all three shapes, bf16
    python benchmarks/run.py --mode gpu-perf --device cpu --smoke --out DIR   # the same code on tiny sizes

nano-vllm's workload: 256 sequences, prompt and output lengths uniform in 100-1,024, all submitted at once,
EOS ignored; output tokens over the wall time from the first submission to the last token. Over gRPC the
server is `python -m llmserve` in its own process, the client this one (llmserve_client.AsyncClient).

Decode step: `batch` sequences decoding at ~300 tokens of context (CUDA graphs on); wall milliseconds per
`EngineCore.step`, and the share of that wall time the GPU spent outside the model call (CUDA events around
each forward, i.e. host work the GPU waited on). The ladder's 32-client figures come from benchmarks/run.py
(`benchmarks/probes/gpu.sh`), whose reports sit beside this file's summary; `ladder32` is left for them.

On the lent GPU machine the wheels it lacks travel with the call (grpcio-health-checking, grpcio-reflection,
grpcio-status, prometheus-client; see the device tool's README).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.paths import child_env
from benchmarks.systems.grpc_e2e import free_port, server_command
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.config import EngineConfig
from llmserve.engine.core import EngineCore
from llmserve.engine.request import GenerationRequest, StoppingParams
from llmserve.models import LoadedModel, random_model
from llmserve_client import AsyncClient, pb

SHAPES = ("smollm2-135m", "qwen3-0.6b", "llama-1b")


def workload(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """nano-vllm's: n (prompt, max_new_tokens), both lengths uniform in `lengths`."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))], rng.randint(*lengths)) for _ in range(n)]


def engine_config(n: int, lengths: tuple[int, int], smoke: bool) -> EngineConfig:
    tokens = n * (2 * lengths[1] + 16)
    return EngineConfig(
        block_size=16,
        kv_cache_tokens=tokens if smoke else None,
        kv_cache_memory_fraction=0.8,
        max_num_seqs=n,
        max_num_batched_tokens=512 if smoke else 8192,
        max_waiting=4 * n,
        max_model_len=2 * lengths[1] + 16,
    )


async def run_inprocess(loaded: LoadedModel, config: EngineConfig, work: list[tuple[list[int], int]]) -> float:
    engine = AsyncEngine(loaded, config)
    await engine.start()
    try:

        async def one(i: int) -> int:
            prompt, new = work[i]
            request = GenerationRequest(f"n{i}", tuple(prompt), stopping=StoppingParams(new, ignore_eos=True))
            count = 0
            async for delta in engine.generate(request):
                count += len(delta.token_ids)
            return count

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(len(work))))
        return sum(counts) / (time.perf_counter() - started)
    finally:
        await engine.shutdown()


async def run_grpc(
    shape: str, device: str, dtype: str, config: EngineConfig, work: list[tuple[list[int], int]]
) -> float:
    port = free_port()
    cmd = server_command(f"random:{shape}", torch.device(device), dtype, port, config, max_streams=4 * len(work))
    cmd += ["--max-model-len", str(config.max_model_len)]
    server = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 600
            while await _health(client) != "SERVING":
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {server.stderr.read() if server.stderr else ''}")
                await asyncio.sleep(0.5)

            async def one(i: int) -> int:
                prompt, new = work[i]
                count = 0
                stream = client.generate(token_ids=prompt, max_new_tokens=new, ignore_eos=True, return_token_ids=True)
                async for response in stream:
                    count += len(response.token_ids)
                    if response.finish_reason not in (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_LENGTH):
                        raise RuntimeError(f"stream {i} ended {response.finish_reason}")
                return count

            started = time.perf_counter()
            counts = await asyncio.gather(*(one(i) for i in range(len(work))))
            return sum(counts) / (time.perf_counter() - started)
    finally:
        server.terminate()
        server.wait(timeout=60)


async def _health(client: AsyncClient) -> str:
    try:
        return await client.health(timeout=2)
    except Exception:  # noqa: BLE001 - not listening yet
        return "DOWN"


def decode_step(loaded: LoadedModel, batch: int, steps: int, context: int) -> dict[str, float]:
    """Wall ms per decode step at `batch` sequences, and the share of it the device was idle (outside forward)."""
    config = EngineConfig(
        block_size=16,
        kv_cache_tokens=batch * (context + steps + 32) + 1024,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch),
    )
    core = EngineCore(loaded, config)
    stopping = StoppingParams(max_new_tokens=steps + 64, ignore_eos=True)
    vocab = loaded.vocab_size
    for i in range(batch):
        prompt = tuple((i * 7 + j) % (vocab - 3) + 3 for j in range(context))
        core.submit(GenerationRequest(f"d{i}", prompt, stopping=stopping))
    core.drain_inbox()
    while len(core.scheduler.running) < batch or any(s.num_uncomputed > 1 for s in core.scheduler.running):
        core.step()
    cuda = loaded.device.type == "cuda"
    spans: list[tuple[Any, Any]] = []
    backend: Any = core.backend
    real = backend.logits

    def timed(plan: Any) -> torch.Tensor:
        if not cuda:
            return real(plan)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real(plan)
        end.record()
        spans.append((start, end))
        return out

    backend.logits = timed
    for _ in range(3):
        core.step()  # warm
    spans.clear()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        core.step()
    if cuda:
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3
    busy_ms = sum(s.elapsed_time(e) for s, e in spans) if cuda else wall_ms
    return {"ms": round(wall_ms / steps, 3), "gpu_idle_share": round(max(0.0, 1 - busy_ms / wall_ms), 3)}


def measure_shape(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    smoke = args.smoke
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    n, lengths = (8, (8, 24)) if smoke else (256, (100, 1024))
    loaded = random_model("tiny" if smoke else shape, dtype=dtype, device=args.device)
    work = workload(n, lengths, loaded.vocab_size)
    config = engine_config(n, lengths, smoke)
    result: dict[str, Any] = {"nanovllm": {}, "decode_step_ms": {}, "gpu_idle_share": {}}
    result["nanovllm"]["llmserve"] = round(asyncio.run(run_inprocess(loaded, config, work)), 1)
    print(f"{shape}: in-process {result['nanovllm']['llmserve']} tok/s", flush=True)
    for batch in (1, 32, 256) if not smoke else (1, 4):
        r = decode_step(loaded, batch, 5 if smoke else 50, 16 if smoke else 300)
        result["decode_step_ms"][str(batch)] = r["ms"]
        result["gpu_idle_share"][str(batch)] = r["gpu_idle_share"]
        print(f"{shape}: decode step at {batch}: {r['ms']} ms, GPU idle {r['gpu_idle_share']:.1%}", flush=True)
    del loaded
    if args.device == "cuda":
        torch.cuda.empty_cache()
    grpc_shape = "tiny" if smoke else shape
    result["nanovllm"]["llmserve_grpc"] = round(asyncio.run(run_grpc(grpc_shape, args.device, dtype, config, work)), 1)
    print(f"{shape}: over gRPC {result['nanovllm']['llmserve_grpc']} tok/s", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/run.py --mode gpu-perf", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--smoke", action="store_true", help="tiny model and workload: checks the script, measures nothing")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    summary: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "command": " ".join(
            ["python", "benchmarks/run.py", "--mode", "gpu-perf", *(argv if argv is not None else sys.argv[1:])]
        ),
    }
    for shape in args.shapes.split(","):
        summary[shape] = measure_shape(shape, args)
        summary[shape]["ladder32"] = None
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("latest-gpu.json" if not args.smoke else "gpu-perf-smoke.json")
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {path}")
    return 0
