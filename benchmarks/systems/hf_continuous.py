"""System 3: transformers' own continuous batching (`ContinuousBatchingManager`, transformers 5.23).

The manager runs its own generation thread over a paged KV cache. Each request is added with
`streaming=True` and a result handler registered on our event loop, so every new token arrives as a
`GenerationOutput` callback and is stamped when it reaches the client side, as for the other systems.
EOS is disabled per request (`eos_token_id=-1`), so every request generates exactly `max_new_tokens`.

On the CPU the baseline gets the best configuration we found on the 2-core machine: "paged|eager" attention
(what transformers switches eager models to; its SDPA path was 6-10x slower per step), 32-token pages (the
default 256 was as much slower) and 128 tokens per step. Its attention runs every query of a step against the
packed KV of every request in the batch (masked), so a step's cost grows with batch size times total context;
at 32 clients 128 tokens per step gave 10.8 output tokens/s, 64 gave 8.1, 256 gave 3.1 and 512 gave 1.5.
On CUDA the model keeps its SDPA attention (transformers moves to flash attention itself when installed), and
the step size and CUDA graphs are left to transformers.
"""

from __future__ import annotations

import asyncio
import math
import time

from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.requests import GenerationOutput

from benchmarks.loadgen import RequestRecord
from benchmarks.systems.base import System
from benchmarks.systems.hf_common import pad_token_id
from benchmarks.workload import BenchRequest
from llmserve.engine.types.model import LoadedModel


class HFContinuousSystem(System):
    """transformers' ContinuousBatchingManager with the llmserve engine's KV capacity in tokens, so neither
    wins by holding more memory. `max_batch_tokens` None leaves the step size to transformers."""

    name = "hf_continuous"

    def __init__(
        self,
        loaded: LoadedModel,
        kv_tokens: int,
        max_batch_tokens: int | None = None,
        max_requests: int = 64,
        page_size: int = 32,
        attn_implementation: str | None = None,
    ) -> None:
        super().__init__(loaded.device)
        self.loaded = loaded
        self.original_attn = loaded.model.config._attn_implementation
        cpu = loaded.device.type == "cpu"
        self.attn_implementation = attn_implementation or ("paged|eager" if cpu else self.original_attn)
        self.cb_config = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=max(1, math.ceil(kv_tokens / page_size)),
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests,
            use_cuda_graph=False if cpu else None,
        )
        self.manager = None

    async def start(self) -> None:
        self.loaded.model.set_attn_implementation(self.attn_implementation)
        generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=pad_token_id(self.loaded))
        self.manager = self.loaded.model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=self.cb_config
        )
        if self.device.type == "cuda":
            await asyncio.to_thread(self.manager.warmup)  # captures its CUDA graphs before the clock starts
        self.manager.start()

    async def stop(self) -> None:
        if self.manager is not None:
            await asyncio.to_thread(self.manager.stop, block=True, timeout=30)
            self.manager = None
        self.loaded.model.set_attn_implementation(self.original_attn)

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        if self.manager is None:
            raise RuntimeError("HFContinuousSystem.start() was not awaited")
        done = asyncio.get_running_loop().create_future()

        def on_output(output: GenerationOutput) -> None:
            now = time.perf_counter()
            new = len(output.generated_tokens) - len(record.token_times)
            record.token_times.extend([now] * max(0, new))
            if output.is_finished() and not done.done():
                if output.error is not None:
                    done.set_exception(RuntimeError(output.error))
                else:
                    done.set_result(None)

        self.manager.register_result_handler(request.request_id, on_output)
        self.manager.add_request(
            list(request.prompt_ids),
            request_id=request.request_id,
            max_new_tokens=request.max_new_tokens,
            streaming=True,
            eos_token_id=-1,
        )
        try:
            await done
        except asyncio.CancelledError:
            self.manager.cancel_request(request.request_id)
            raise
        record.end = time.perf_counter()
