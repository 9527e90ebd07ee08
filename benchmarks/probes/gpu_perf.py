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
import functools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.serve import Server, engine_flags
from llmserve.engine.backends.paged import TransformersForward
from llmserve.engine.backends.piecewise import MixedSteps
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import random_model
from llmserve.models.random_shapes import RANDOM_SHAPES
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


class Tally:
    """Output tokens streamed so far; a run stops at `cap_s` (its streams cancelled) and reports the rate so far."""

    def __init__(self) -> None:
        self.tokens = 0


async def _timed(streams: list[Any], tally: Tally, cap_s: float) -> dict[str, Any]:
    """Run the streams (coroutines that add to `tally`) until all end or `cap_s` passes: output tokens/s."""
    started = time.perf_counter()
    tasks = [asyncio.ensure_future(s) for s in streams]
    done, pending = await asyncio.wait(tasks, timeout=cap_s)
    elapsed = time.perf_counter() - started
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()  # a stream that failed fails the run
    return {"tok_s": round(tally.tokens / elapsed, 1), "capped": bool(pending), "s": round(elapsed, 1)}


async def run_inprocess(
    loaded: LoadedModel, config: EngineConfig, work: list[tuple[list[int], int]], cap_s: float
) -> dict[str, Any]:
    engine = AsyncEngine(loaded, config)
    await engine.start()
    tally = Tally()
    try:

        async def one(i: int) -> None:
            prompt, new = work[i]
            request = GenerationRequest(f"n{i}", tuple(prompt), stopping=StoppingParams(new, ignore_eos=True))
            async for delta in engine.generate(request):
                tally.tokens += len(delta.token_ids)

        return await _timed([one(i) for i in range(len(work))], tally, cap_s)
    finally:
        await engine.shutdown()


async def run_grpc(
    shape: str,
    device: str,
    dtype: str,
    config: EngineConfig,
    work: list[tuple[list[int], int]],
    cap_s: float,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The workload over gRPC against `python -m llmserve` (the engine process; `extra` flags such as
    --engine-in-process); its start-up time is reported beside the rate."""
    flags = [*engine_flags(config, max_streams=4 * len(work)), "--max-model-len", str(config.max_model_len), *extra]
    started = time.perf_counter()
    with Server(flags, model=f"random:{shape}", device=device, dtype=dtype) as server:
        await server.wait_serving(timeout_s=600)
        start_s = round(time.perf_counter() - started, 1)
        tally = Tally()
        async with AsyncClient(server.address) as client:

            async def one(i: int) -> None:
                prompt, new = work[i]
                stream = client.generate(token_ids=prompt, max_new_tokens=new, ignore_eos=True, return_token_ids=True)
                async for response in stream:
                    tally.tokens += len(response.token_ids)
                    if response.finish_reason not in (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_LENGTH):
                        raise RuntimeError(f"stream {i} ended {response.finish_reason}")

            result = await _timed([one(i) for i in range(len(work))], tally, cap_s)
        return {**result, "server_start_s": start_s}


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
    real = backend.paged.logits  # the step's way to a plain step's logits (graphs, mixed steps or eager)

    def timed(plan: Any) -> torch.Tensor:
        if not cuda:
            return real(plan)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real(plan)
        end.record()
        spans.append((start, end))
        return out

    backend.paged.logits = timed
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


def start_timing(shape: str, device: str, dtype: str, max_seqs: int = 256) -> dict[str, Any]:
    """What a CUDA start costs, part by part: the weights, the graphs' memory estimate (one eager forward of the
    largest bucket: the Triton kernel's first compile happens here), then the backend with every bucket's graph
    captured (the Triton kernel's compile for the other shapes, and the captures)."""
    from llmserve.engine.backends import create_backend
    from llmserve.engine.backends import cuda as cuda_backend

    times: dict[str, float] = {}
    real_reserve, real_build = cuda_backend.graph_reserve, cuda_backend.DecodeGraphs.build_all

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] = round(time.perf_counter() - t0, 2)

        return run

    t0 = time.perf_counter()
    loaded = random_model(shape, dtype=dtype, device=device)
    times["load_s"] = round(time.perf_counter() - t0, 2)
    config = EngineConfig(
        block_size=16,
        kv_cache_memory_fraction=0.5,
        cpu_kv_cache_bytes=1 << 24,  # the dry run's cache (on CUDA the memory fraction sizes it)
        max_num_seqs=max_seqs,
        max_num_batched_tokens=8192,
        attention_kernel="triton",
    )
    cuda_backend.graph_reserve = timed("graph_reserve_s", real_reserve)  # type: ignore[assignment]
    cuda_backend.DecodeGraphs.build_all = timed("capture_s", real_build)  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        backend: Any = create_backend(loaded, config, 2048, kind="cuda", capture=device == "cuda")
        times["backend_s"] = round(time.perf_counter() - t0, 2)
    finally:
        cuda_backend.graph_reserve, cuda_backend.DecodeGraphs.build_all = real_reserve, real_build  # type: ignore[method-assign]
    mib = 2**20
    return {
        **times,
        "graphs": len(backend.graphs),
        "captured": backend.graphs.captures,
        "reserved_mib": round(backend.reserved_bytes / mib, 1),
        "taken_mib": None if backend.graph_bytes is None else round(backend.graph_bytes / mib, 1),
        "description": backend.description,
    }


def mixed_step(loaded: LoadedModel, mode: str, smoke: bool) -> dict[str, Any]:
    """Steps that mix a prompt chunk with decodes under `--mixed-steps mode`: 32 sequences decoding while one long
    prompt is computed in chunks of 512 (2 and 16 in a smoke run); ms per mixed step after the first (which compiles,
    under the compile modes: its time is reported apart), and the first's."""
    batch, chunk = (2, 16) if smoke else (32, 512)
    config = EngineConfig(
        block_size=16,
        kv_cache_tokens=(batch + 1) * 4096 + 1024,
        max_num_seqs=batch + 1,
        max_num_batched_tokens=batch + chunk,
        mixed_steps=mode,
        attention_kernel="triton",
    )
    core = EngineCore(loaded, config)
    if loaded.device.type != "cuda":  # the dry run: the CUDA backend's logic, eagerly, on the CPU
        from llmserve.engine.backends import create_backend

        core.backend = backend = create_backend(loaded, config, core.max_model_len, kind="cuda", capture=False)
        if mode != "eager":  # aot_eager: the same graph breaks, without inductor's minute of compiling on a CPU
            forward = functools.partial(TransformersForward.logits, backend.forward)  # type: ignore[attr-defined]
            backend.mixed = MixedSteps(forward, backend.graphs.steps, mode, compiler="aot_eager")  # type: ignore[attr-defined]
    vocab = loaded.vocab_size
    stopping = StoppingParams(max_new_tokens=1024, ignore_eos=True)
    for i in range(batch):
        core.submit(
            GenerationRequest(f"m{i}", tuple((i * 7 + j) % (vocab - 3) + 3 for j in range(chunk)), stopping=stopping)
        )
    core.drain_inbox()
    while len(core.scheduler.running) < batch or any(s.num_uncomputed > 1 for s in core.scheduler.running):
        if core.dead_reason is not None:
            raise RuntimeError(core.dead_reason)
        core.step()
    long = tuple((j * 11) % (vocab - 3) + 3 for j in range(chunk * (2 if smoke else 9)))
    core.submit(GenerationRequest("long", long, stopping=StoppingParams(max_new_tokens=1, ignore_eos=True)))
    core.drain_inbox()
    times = []
    while any(s.num_uncomputed > 1 for s in core.scheduler.running) or core.scheduler.num_waiting:
        if core.dead_reason is not None or len(times) > 64:
            raise RuntimeError(f"the mixed steps did not end: {core.dead_reason or f'{len(times)} steps'}")
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        core.step()
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    rest = sorted(times[1:]) or [float("nan")]
    return {"first_ms": round(times[0], 1), "ms": round(rest[len(rest) // 2], 3), "steps": len(times)}


PARTS = ("start", "inprocess", "decode", "grpc", "mixed")


def measure_shape(shape: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The parts `args.parts` names for one shape, into `result` (written after each part by the caller)."""
    smoke = args.smoke
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    n, lengths = (8, (8, 24)) if smoke else (256, (100, 1024))
    model = "tiny" if smoke else shape
    config = engine_config(n, lengths, smoke)
    work = workload(n, lengths, RANDOM_SHAPES[model]().vocab_size)
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            if part == "start":
                result["start"] = start_timing(model, args.device, dtype, 8 if smoke else 256)
            elif part == "inprocess":
                loaded = random_model(model, dtype=dtype, device=args.device)
                result.setdefault("nanovllm", {})["llmserve"] = asyncio.run(
                    run_inprocess(loaded, config, work, args.cap_s)
                )
            elif part == "decode":
                loaded = random_model(model, dtype=dtype, device=args.device)
                for batch in (1, 4) if smoke else (1, 32, 256):
                    r = decode_step(loaded, batch, 5 if smoke else 50, 16 if smoke else 300)
                    result.setdefault("decode_step_ms", {})[str(batch)] = r["ms"]
                    result.setdefault("gpu_idle_share", {})[str(batch)] = r["gpu_idle_share"]
            elif part == "grpc":
                nano = result.setdefault("nanovllm", {})
                for key, extra in (
                    ("llmserve_grpc", ()),
                    ("llmserve_grpc_engine_in_process", ("--engine-in-process",)),
                ):
                    nano[key] = asyncio.run(run_grpc(model, args.device, dtype, config, work, args.cap_s, extra))
            elif part == "mixed":
                loaded = random_model(model, dtype=dtype, device=args.device)
                # The dry run steps eagerly only: on the CPU, Dynamo traces every compiled mixed step anew (~90% of
                # the dry run's time), and tests/engine/backends/test_piecewise.py already runs both compile modes
                # against generate. Each mode's figure is written as it ends: a compile may run long.
                modes = ("eager",) if smoke else ("eager", "compile", "compile-graphs")
                for m in modes:
                    result.setdefault("mixed_step_ms", {})[m] = mixed_step(loaded, m, smoke)
                    args.write()
            else:
                raise ValueError(f"unknown part {part!r}: {', '.join(PARTS)}")
        except Exception as exc:  # record and go on: one shot at the device
            result.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"
        print(f"{shape} {part} ({time.perf_counter() - t0:.0f} s): {json.dumps({k: result.get(k) for k in result})}")
        args.write()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/run.py --mode gpu-perf", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--cap-s", type=float, default=60.0, help="a nano-vllm run stops here and reports its rate so far")
    p.add_argument("--smoke", action="store_true", help="tiny model and workload: checks the script, measures nothing")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.device == "cpu":  # the dry run: the varlen kernel through Triton's interpreter, mended for NumPy 2.4
        from tests.testing import mend_triton_interpreter

        mend_triton_interpreter()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("latest-gpu.json" if not args.smoke else "gpu-perf-smoke.json")
    # Several runs (one per part, each under its own time limit in gpu.sh) add to one summary.
    summary: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    summary.update(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
    )
    command = " ".join(
        ["python", "benchmarks/run.py", "--mode", "gpu-perf", *(argv if argv is not None else sys.argv[1:])]
    )
    summary.setdefault("commands", []).append(command)
    args.write = lambda: path.write_text(json.dumps(summary, indent=2) + "\n")
    for shape in args.shapes.split(","):
        result = summary.setdefault(shape, {"ladder32": None})
        measure_shape(shape, args, result)
    print(f"wrote {path}")
    return 0
