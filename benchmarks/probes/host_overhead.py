"""Host work per engine step: everything but the model call, measured with the model call stubbed out.

A step's host work is scheduling, the step plan, the backend's metadata (packed row, slots, block tables,
decode groups or graph buffers), sampling and emitting the deltas. On a GPU it is the time the device may sit
idle between steps, so it must stay small as the batch grows. This script builds the real engine over a
2-layer tiny Llama, keeps `batch` sequences decoding, replaces only the model call (`backend.forward.logits`:
transformers' forward, or the fused forward on the CPU) with one that returns ready logits, and times
`EngineCore.step()`.

    python benchmarks/run.py --mode host-overhead             # CPU backend, the CUDA and torch backends' paths
    python benchmarks/run.py --mode host-overhead --batches 32 64 256 --steps 300
    python benchmarks/run.py --mode host-overhead --front-end   # deltas through AsyncEngine to an event loop
    python benchmarks/run.py --mode host-overhead --front-end --engine-process   # the core in a process of its own

With --front-end every request is a stream of AsyncEngine.generate consumed on an event loop thread, as in the
server, and a step's time includes handing its deltas to that loop. With --engine-process as well, the core runs
in a child process (core/process.py, as `python -m llmserve` runs it) and the figure is the child's step loop:
the time from one step's start to the next's, its outputs' pickling and sending included.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.metrics import percentile
from llmserve.engine.backends import Backend, Kind, create_backend
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.core.process import ChildSpec, ProcessCore
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.frontend.output_processor import OutputProcessor
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import GenerationRequest, SamplingParams, StoppingParams
from llmserve.models.loader import from_config
from tests.testing import tiny_config

VOCAB = 512


# With --tokenizer the stub's logits pick this id, a plain word piece in SmolLM2's vocabulary (under VOCAB).
TEXT_TOKEN = 300


def stub_model_call(core: EngineCore, forward_ms: float = 0.0) -> None:
    """Replace the backend's model call (not its metadata) with ready logits of the right shape, after
    `forward_ms` of sleep (a device's forward as the host sees it: a wait that holds neither the GIL nor a core)."""
    backend = core.backend
    logits = torch.zeros(1024, VOCAB)
    logits[:, TEXT_TOKEN] = 1.0

    def forward(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None,
        batch: object,
        lora: object = None,
    ) -> torch.Tensor:
        if forward_ms:
            time.sleep(forward_ms / 1e3)
        return logits[: input_ids.shape[1] if keep is None else len(keep)]

    backend.forward.logits = forward  # type: ignore[method-assign]


def submit_through_front_end(
    engine: AsyncEngine, requests: list[GenerationRequest], loop: asyncio.AbstractEventLoop | None = None
) -> Callable[[], None]:
    """Consume each request's stream on an event loop thread of its own (or on `loop`, running), as the server
    does; returns what cancels the streams (and stops the loop it started)."""
    own = loop is None
    if loop is None:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

    ended: list[str] = []

    async def consume(request: GenerationRequest) -> None:
        try:
            async for _ in engine.generate(request):
                pass
        finally:
            ended.append(request.request_id)

    streams = [asyncio.run_coroutine_threadsafe(consume(request), loop) for request in requests]
    while len(engine._processor) < len(requests):  # every stream registered (and so submitted)
        time.sleep(0.01)

    def stop() -> None:
        for stream in streams:
            stream.cancel()
        while len(ended) < len(streams):
            time.sleep(0.01)
        if own:
            loop.call_soon_threadsafe(loop.stop)

    return stop


def probe_backend(core: EngineCore, name: str) -> Backend:
    """The backend a probe measures: `cpu` (the core's own), `cuda-path-triton` (the CUDA backend: its step buffers
    and decode graphs' padded forwards, run eagerly on the CPU), `torch-path` (the torch backend's gathered
    attention, which CUDA without Triton serves)."""
    if name == "cpu":
        return core.backend
    kind: Kind = "cuda" if name == "cuda-path-triton" else "torch"
    return create_backend(core.loaded, core.config, core.max_model_len, kind=kind, capture=False)


def time_executes(core: EngineCore) -> list[tuple[float, float]]:
    """Record when each of the backend's steps starts and ends (perf_counter seconds), in order."""
    backend, spans = core.backend, []
    execute = backend.execute

    def timed(plan: object) -> object:
        started = time.perf_counter()
        try:
            return execute(plan)  # type: ignore[arg-type]
        finally:
            spans.append((started, time.perf_counter()))

    backend.execute = timed  # type: ignore[method-assign,assignment]
    return spans


def probe_model(tokenizer: bool) -> LoadedModel:
    """The probe's model: the tiny Llama, with SmolLM2's tokenizer when `tokenizer` (module level: an engine
    process builds it with this too)."""
    loaded = from_config(tiny_config("llama", vocab_size=VOCAB, max_positions=4096), dtype=torch.float32)
    if tokenizer:
        from llmserve.models.loader import load_model

        loaded.tokenizer = load_model().tokenizer
    return loaded


def timed_child_model(tokenizer: bool, backend: str, batch: int, steps: int, out: Path) -> LoadedModel:
    """In the engine process (a ChildSpec's `load`): the probe's model, with the core about to be built over it set
    up as `measure` sets it (the backend, the stubbed model call) and a timer on its step loop that writes `steps`
    pass times (once all `batch` sequences decode) to `out`. The core is reached through its class, patched in this
    process only: the probe's hook, kept out of the server's code."""
    torch.set_num_threads(1)
    warm_up = EngineCore.warm_up

    def prepare_then_warm_up(core: EngineCore) -> None:
        prepare_child(core, backend, batch, steps, out)
        warm_up(core)

    EngineCore.warm_up = prepare_then_warm_up  # type: ignore[method-assign]
    return probe_model(tokenizer)


def prepare_child(core: EngineCore, backend: str, batch: int, steps: int, out: Path) -> None:
    core.backend = probe_backend(core, backend)
    stub_model_call(core)
    step = core.step
    times: list[float] = []
    last = [0.0]

    def timed_step() -> None:
        started = time.perf_counter()
        running = core.scheduler.running
        decoding = len(running) == batch and all(s.num_uncomputed <= 1 for s in running)
        if decoding and last[0] and len(times) < steps:
            times.append((started - last[0]) * 1e3)
            if len(times) == steps:  # whole or not at all: the parent reads the file as soon as it exists
                part = out.with_suffix(".part")
                part.write_text(json.dumps(times))
                part.replace(out)
        last[0] = started if decoding else 0.0
        step()

    core.step = timed_step  # type: ignore[method-assign]


def measure_engine_process(
    batch: int, backend: str, steps: int, config: EngineConfig, tokenizer: bool, requests: list[GenerationRequest]
) -> list[float]:
    """Pass times of the child's step loop with every request streamed through the front end in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        spec = ChildSpec(functools.partial(timed_child_model, tokenizer, backend, batch, steps, out), config)
        client = ProcessCore(spec)
        client.wait_ready()
        assert client.card is not None
        engine = AsyncEngine(client.card, config, core=client)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(engine.start(), loop).result()
        # The tokenizer's facts first (a scan of its vocabulary, once): the child steps while requests arrive, and
        # the first must not run alone to its end while that scan holds up the others.
        OutputProcessor(client.card.tokenizer).add(0, requests[0], lambda delta: None)
        stop = submit_through_front_end(engine, requests, loop)
        deadline = time.monotonic() + 300
        while not out.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine process did not time {steps} steps of {batch} decoding sequences")
            time.sleep(0.05)
        times = json.loads(out.read_text())
        stop()
        asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        return times


def measure(
    batch: int,
    backend: str,
    steps: int,
    prompt: int = 100,
    front_end: bool = False,
    tokenizer: object = None,
    engine_process: bool = False,
    sampled: bool = False,
    async_scheduling: bool = False,
    forward_ms: float = 0.0,
) -> dict[str, float]:
    """Median and P90 host milliseconds per decode step with `batch` sequences running (detokenized with
    `tokenizer` where the engine does that, when one is given); in process, also the median gap between one
    backend step's end and the next one's start (`gap_ms`: what a device would sit idle for beyond the backend's
    own staging and sampling)."""
    # Room to generate well past the timed steps: with the engine process the child steps while the front end is
    # still submitting (a stubbed step at 32 sequences takes 0.1 ms), and a request that ended before the last one
    # arrived left the batch short of `batch` for good (the timer never started: a hang until the deadline).
    new_tokens = steps + 64 + 1024
    config = EngineConfig(
        block_size=16,
        kv_cache_tokens=batch * (prompt + new_tokens) + 1024,
        max_num_seqs=batch,
        max_num_batched_tokens=max(512, batch),
        cuda_graphs=False,
        # cuda-path-triton: the GPU's default, the varlen kernel (its graphs take block tables as wide as the
        # context limit, 4,096 tokens here); torch-path: the torch attention's gathered decode (CUDA without Triton).
        attention_kernel="triton" if backend == "cuda-path-triton" else "torch",
        async_scheduling=async_scheduling,
    )
    stopping = StoppingParams(max_new_tokens=new_tokens, ignore_eos=True)
    # --sampled: every request samples (temperature, top-p, its own seed) instead of taking the argmax.
    sampling = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i) if sampled else SamplingParams() for i in range(batch)
    ]
    requests = [
        GenerationRequest(f"r{i}", tuple(range(1, prompt + 1)), sampling=sampling[i], stopping=stopping)
        for i in range(batch)
    ]
    if engine_process:
        times = sorted(measure_engine_process(batch, backend, steps, config, tokenizer is not None, requests))
        return {"median_ms": statistics.median(times), "p90_ms": percentile(times, 90)}
    loaded = from_config(tiny_config("llama", vocab_size=VOCAB, max_positions=4096), dtype=torch.float32)
    loaded.tokenizer = tokenizer
    engine = AsyncEngine(loaded, config) if front_end else None
    core = engine.core.engine_core if engine is not None else EngineCore(loaded, config)  # type: ignore[attr-defined]
    core.backend = probe_backend(core, backend)
    stub_model_call(core, forward_ms)
    stop = None
    if engine is not None:
        stop = submit_through_front_end(engine, requests)
    else:
        for request in requests:
            core.submit(request)
    # The step thread's hand-off of each step's outputs: to the event loop with the front end, else dropped.
    emit: Callable[[list], None] = engine._emit if engine is not None else (lambda outputs: None)
    core.drain_inbox()
    while len(core.scheduler.running) < batch or any(s.num_uncomputed > 1 for s in core.scheduler.running):
        core.step()  # prefill until every sequence decodes one token a step
        emit(core.take_outputs())
    spans = time_executes(core)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()
        emit(core.take_outputs())
        times.append((time.perf_counter() - started) * 1e3)
    if stop is not None:
        stop()
    times.sort()
    gaps = [(b[0] - a[1]) * 1e3 for a, b in zip(spans, spans[1:], strict=False)]
    return {
        "median_ms": statistics.median(times),
        "p90_ms": percentile(times, 90),
        "gap_ms": statistics.median(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/run.py --mode host-overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--backends",
        nargs="+",
        default=["cpu", "torch-path", "cuda-path-triton"],
        choices=["cpu", "torch-path", "cuda-path-triton"],
    )
    p.add_argument("--front-end", action="store_true", help="stream every request through AsyncEngine.generate")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--tokenizer", action="store_true", help="detokenize with the default model's tokenizer")
    p.add_argument("--engine-process", action="store_true", help="with --front-end: the core in a child process")
    p.add_argument("--sampled", action="store_true", help="every request samples (temperature 0.8, top-p 0.95)")
    p.add_argument("--async-scheduling", action="store_true", help="overlap: the next step planned while one runs")
    p.add_argument("--forward-ms", type=float, default=0.0, help="in process: the stubbed forward sleeps this long")
    args = p.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from llmserve.models.loader import load_model

        tokenizer = load_model().tokenizer
    torch.set_num_threads(1)  # host work is one thread's work; keep the figures comparable across machines
    results = {}
    for backend in args.backends:
        for batch in args.batches:
            r = measure(
                batch,
                backend,
                args.steps,
                front_end=args.front_end,
                tokenizer=tokenizer,
                engine_process=args.engine_process,
                sampled=args.sampled,
                async_scheduling=args.async_scheduling,
                forward_ms=args.forward_ms,
            )
            results[f"{backend}/{batch}"] = r
            gap = f", gap {r['gap_ms']:.3f} ms" if "gap_ms" in r else ""
            print(f"{backend:10s} batch {batch:4d}: median {r['median_ms']:.3f} ms, p90 {r['p90_ms']:.3f} ms{gap}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
