"""How many pooling tokens a step may carry beside few generating streams before generation drops below 0.8x.

One or two greedy streams of 160 tokens on the default model (`--pooling last`), alone, then beside a backlog of
pooling requests (Embed inputs of ~60 tokens) with the scheduler's pooling cap fixed at P tokens a step: the
streams' time per output token alone over beside the backlog is what generation keeps. From it, the step's fixed
cost in tokens F of the scheduler's cost model (a step costs ~ F + its tokens): keeping 0.8x at cap P beside G
streams means P <= (F + G) / 4.

    python -m benchmarks.probes.pooling_share [--caps 8,32,128] [--streams 1]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import GenerationRequest, PoolingParams, StoppingParams
from llmserve.models.loader import load_model

NEW_TOKENS = 160


async def _stream(engine: AsyncEngine, i: int) -> float:
    request = GenerationRequest(
        f"g{i}-{time.monotonic_ns()}", tuple(range(100, 140)), stopping=StoppingParams(NEW_TOKENS, ignore_eos=True)
    )
    first = end = 0.0
    async for _ in engine.generate(request):
        end = time.perf_counter()
        if not first:
            first = end
    return (end - first) / (NEW_TOKENS - 1)


async def _pool(engine: AsyncEngine, i: int) -> None:
    prompt = tuple(200 + (i * 7 + k) % 3000 for k in range(60))
    request = GenerationRequest(
        f"p{i}-{time.monotonic_ns()}", prompt, stopping=StoppingParams(1), pooling=PoolingParams(PoolingMode.LAST)
    )
    async for _ in engine.generate(request):
        pass


async def _rounds(loaded: object, caps: list[int], streams: int, rounds: int) -> None:
    """One engine (its core on a thread here); each cap set on its scheduler in place, alone and capped alternated."""
    from llmserve.engine.core.engine_core import ThreadCore

    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=512, cuda_graphs=False)
    engine = AsyncEngine(loaded, config)  # type: ignore[arg-type]
    await engine.start()
    assert isinstance(engine.core, ThreadCore)
    scheduler = engine.core.engine_core.scheduler
    try:
        await _stream(engine, -1)  # warm
        for r in range(rounds):
            for cap in caps:
                alone = sum(await asyncio.gather(*(_stream(engine, i) for i in range(streams)))) / streams
                # pooling_share s gives a cap of floor((G + F) s / (1 - s)) tokens beside G streams (F the step's
                # fixed cost in tokens): with F 0, s = P / (P + G) gives P.
                # M 0: the cap every step (the core measured F and M at start: neither applies here).
                scheduler.pooling_share, scheduler.pooling_step_tokens = cap / (cap + streams), 0
                scheduler.pooling_chunk_tokens = 0
                backlog = [asyncio.ensure_future(_pool(engine, i)) for i in range(400)]
                await asyncio.sleep(0.05)
                beside = sum(await asyncio.gather(*(_stream(engine, i) for i in range(streams)))) / streams
                for task in backlog:
                    task.cancel()
                await asyncio.gather(*backlog, return_exceptions=True)
                scheduler.pooling_share = 1.0
                kept = alone / beside
                # kept = (F + G) / (F + G + P)  =>  F = P kept / (1 - kept) - G
                fixed = cap * kept / (1 - kept) - streams if kept < 1 else float("inf")
                print(
                    f"round {r} streams {streams} cap {cap:3d}: TPOT alone {alone * 1e3:6.2f} ms, beside "
                    f"{beside * 1e3:6.2f} ms, kept {kept:.3f}, fixed cost ~{fixed:.0f} tokens",
                    flush=True,
                )
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--caps", default="8,32,128")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model(pooling="last")
    asyncio.run(_rounds(loaded, [int(c) for c in args.caps.split(",")], args.streams, args.rounds))


if __name__ == "__main__":
    main()
