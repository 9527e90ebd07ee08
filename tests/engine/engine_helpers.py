"""Helpers shared by the engine tests: a tiny engine's config, requests, streaming a request to its end, an engine
over either core (on a thread, or in an engine process), and a core stepped by hand on the calling thread with an
output processor as the front end would."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore, ThreadCore
from llmserve.engine.core.process import ChildSpec, ProcessCore
from llmserve.engine.frontend.async_engine import AsyncEngine, build_engine
from llmserve.engine.frontend.output_processor import OutputProcessor
from llmserve.engine.sched.block_pool import BlockPool
from llmserve.engine.spec.policy import CostTable
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import (
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)
from llmserve.models.loader import from_config
from tests.forking_launcher import forking_launcher
from tests.testing import tiny_config

CONFIG = EngineConfig(block_size=16, kv_cache_tokens=4096, max_num_seqs=16, max_num_batched_tokens=256)
# The two implementations of core/client.Core: the step loop on a thread, and in an engine process of its own.
CORES = ("thread", "process")


def clear_cache(pool: BlockPool) -> None:
    """Forget every cached (unreferenced) prefix, its blocks free: allocating every block allocate() can hand out
    evicts the cached ones, oldest first, and releasing them frees them unhashed (the pool has no call of its own
    for this: only tests want it)."""
    pool.release(pool.allocate(pool.num_free))


def tiny64(max_positions: int = 512) -> LoadedModel:
    """The engine tests' model: the tiny Llama in float64 (module level: an engine process builds it too)."""
    return from_config(tiny_config(max_positions=max_positions), dtype=torch.float64)


async def start_engine(
    kind: str, load: Callable[[], LoadedModel] = tiny64, config: EngineConfig = CONFIG
) -> AsyncEngine:
    """A started engine over the model `load` builds, its core on a thread (`kind` "thread") or in an engine
    process ("process", as `python -m llmserve` runs it, forked from this worker's preloaded interpreter)."""
    if kind == "thread":
        engine = await build_engine(load, config)
    else:
        engine = await build_engine(load, config, ProcessCore(ChildSpec(load, config), forking_launcher()))
    await engine.start()
    return engine


def inner(engine: AsyncEngine) -> EngineCore:
    """The EngineCore of an engine whose core runs on a thread here (for the tests that reach into its books)."""
    assert isinstance(engine.core, ThreadCore)
    return engine.core.engine_core


def kill_core(engine: AsyncEngine) -> None:
    """Make the core die under its requests: the engine process killed (SIGKILL), or on a thread, a fault in its
    books (the next step raises, as a scheduler bug would)."""
    if isinstance(engine.core, ProcessCore):
        os.kill(engine.core.process.pid, signal.SIGKILL)
        return

    def broken() -> None:
        raise RuntimeError("books out of balance")

    inner(engine).scheduler.schedule = broken  # type: ignore[method-assign]


# Every generation here takes well under a second: a stuck engine fails the test in seconds, not at pytest's timeout.
RUN_TIMEOUT_S = 30.0


async def run(engine: AsyncEngine, request: GenerationRequest) -> tuple[list[int], list]:
    tokens, deltas = [], []
    async with asyncio.timeout(RUN_TIMEOUT_S):
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
            deltas.append(delta)
    return tokens, deltas


async def token_logprobs(
    engine: AsyncEngine, requests: list[GenerationRequest], together: bool, timeout_s: float = 120.0
) -> list[list[tuple[int, float]]]:
    """Each request's (token id, logprob) pairs: the requests one after another, or all at once (`together`)."""

    async def one(r: GenerationRequest) -> list[tuple[int, float]]:
        out: list[tuple[int, float]] = []
        async for delta in engine.generate(r):
            out += [(lp.token_id, lp.logprob) for lp in delta.logprobs or []]
        return out

    if together:
        return list(await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), timeout_s))
    return [await asyncio.wait_for(one(r), timeout_s) for r in requests]


def req(
    rid: str, prompt: list[int], *, max_new: int = 16, sampling: SamplingParams | None = None, **kw
) -> GenerationRequest:
    stopping = kw.pop("stopping", StoppingParams(max_new_tokens=max_new, ignore_eos=True))
    return GenerationRequest(rid, tuple(prompt), sampling=sampling or SamplingParams(), stopping=stopping, **kw)


def stepped_core(**overrides) -> EngineCore:  # noqa: ANN003
    settings = dict(block_size=16, kv_cache_tokens=1024, max_num_seqs=4, max_num_batched_tokens=64)
    settings.update(overrides)
    return EngineCore(from_config(tiny_config(max_positions=512), dtype=torch.float32), EngineConfig(**settings))


def serve(core: EngineCore, request: GenerationRequest, max_steps: int = 200) -> list:
    """Submit and step on this thread until the request's final delta; returns every delta, made by an output
    processor over the model's tokenizer as the front end would."""
    deltas: list = []
    processor = OutputProcessor(core.loaded.tokenizer)
    processor.add(core.submit(request), request, deltas.append)
    for _ in range(max_steps):
        core.drain_inbox()
        for handle, keep in processor.process(core.take_outputs()):
            core.abort(handle, keep)
        if deltas and deltas[-1].finished:
            return deltas
        core.step()
    raise AssertionError("no final delta")


class PieceTokenizer:
    """Each id is a byte string, as in byte-level BPE: decode joins them and decodes UTF-8 with replacement."""

    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces.get(i, b"?") for i in token_ids).decode("utf-8", errors="replace")


def with_text(core: EngineCore, prompt: list[int], n: int) -> tuple[list[int], dict[int, bytes], str]:
    """The greedy tokens for `prompt`, a tokenizer that spells each distinct one as a letter, and their text."""
    greedy = [t for d in serve(core, req("greedy", prompt, max_new=n)) for t in d.token_ids]
    pieces = {t: bytes([ord("a") + i]) for i, t in enumerate(dict.fromkeys(greedy))}
    core.loaded.tokenizer = PieceTokenizer(pieces)
    return greedy, pieces, "".join(pieces[t].decode() for t in greedy)


def table_rows(table: CostTable) -> list[dict[str, float]]:
    """The table as rows (what calibrate.load_table reads under "rows"), for a test's --speculative-cost-table."""
    return [
        {"batch": b, "k": k, "forward_ms": table.ms[i][j]}
        for i, b in enumerate(table.batches)
        for j, k in enumerate(table.ks)
    ]
