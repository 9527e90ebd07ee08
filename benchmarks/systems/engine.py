"""System 4: the llmserve engine in-process (`AsyncEngine`), no gRPC in between."""

from __future__ import annotations

import time

from benchmarks.loadgen import RequestRecord
from benchmarks.systems.base import System
from benchmarks.workload import BenchRequest
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.outputs import FinishReason
from llmserve.engine.types.request import GenerationRequest, StoppingParams

_OK = {FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP_SEQUENCE, FinishReason.STOP_TOKEN}


async def stream_into(
    engine: AsyncEngine, request: BenchRequest, record: RequestRecord, session_id: str | None = None
) -> None:
    """Serve one benchmark request on `engine`, stamping tokens as their deltas arrive.

    Leaving early (cancellation) closes the delta stream, which aborts the request in the engine.
    """
    generation = GenerationRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_ids,
        stopping=StoppingParams(max_new_tokens=request.max_new_tokens, ignore_eos=True),
        session_id=session_id,
    )
    deltas = engine.generate(generation)
    try:
        async for delta in deltas:
            now = time.perf_counter()
            record.token_times.extend([now] * len(delta.token_ids))
            if delta.usage is not None:
                record.cached_prompt_tokens = delta.usage.cached_prompt_tokens
            if delta.finished:
                if delta.finish_reason not in _OK:
                    raise RuntimeError(f"finished with {delta.finish_reason.value}: {delta.error}")
                record.end = now
    finally:
        await deltas.aclose()


class EngineSystem(System):
    """llmserve's continuous-batching engine, driven directly from the benchmark's event loop."""

    name = "llmserve"

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        super().__init__(loaded.device)
        self.loaded = loaded
        self.config = config
        self.engine: AsyncEngine | None = None

    async def start(self) -> None:
        self.engine = AsyncEngine(self.loaded, self.config)
        await self.engine.start()

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
            self.engine = None

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        if self.engine is None:
            raise RuntimeError("EngineSystem.start() was not awaited")
        await stream_into(self.engine, request, record)
