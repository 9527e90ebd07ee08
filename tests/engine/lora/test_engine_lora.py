"""LoRA adapters through the whole engine, over both cores (on a thread, and in an engine process as `python -m
llmserve` runs it): three adapters of different ranks and base requests in one batch, under chunked prefill,
preemption and the --max-loras bound (2 slots for 3 adapters), with the prefix cache on and prompts shared across
adapters, each request's greedy output equal to `generate` on PEFT's merge_and_unload of its adapter alone
(float32); with speculative decoding, every draft row verified under its sequence's adapter; sessions that switch
adapter recompute; the AdapterService calls and their refusals."""

from __future__ import annotations

import asyncio
import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.spec.policy import CostTable
from llmserve.engine.types.adapters import (
    AdapterExists,
    AdapterNotFound,
    AdapterRefused,
    AdaptersBusy,
    ListAdapters,
    LoadAdapter,
    UnknownAdapter,
    UnloadAdapter,
)
from tests.engine.engine_helpers import CORES, req, run, start_engine, table_rows
from tests.engine.lora.peft_adapters import make_adapter
from tests.testing import greedy_reference, tiny_model

ADAPTERS: dict[str, dict[str, Any]] = {
    "all-r2": dict(r=2, lora_alpha=4),
    "qvd-r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "kogu-r8": dict(r=8, lora_alpha=16, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
}
BASE = None


@dataclass(slots=True)
class Made:
    folders: dict[str, Path]
    merged: dict[str | None, Any]  # adapter name (None: base) -> the model generate runs on

    def expected(self, name: str | None, prompt: list[int], new: int) -> list[int]:
        return greedy_reference(self.merged[name], prompt, new)

    def config(self, **overrides: Any) -> EngineConfig:
        settings: dict[str, Any] = dict(
            block_size=16, kv_cache_tokens=16 * 12, max_num_seqs=8, max_num_batched_tokens=40,
            loras=tuple((name, str(self.folders[name])) for name in ADAPTERS), max_loras=2, max_lora_rank=8,
        )  # fmt: skip
        settings.update(overrides)
        return EngineConfig(**settings)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    base = tiny_model("llama").model  # the engines build the same model (seed 0) for themselves
    base.set_attn_implementation("sdpa")
    root = tmp_path_factory.mktemp("engine-adapters")
    merged: dict[str | None, Any] = {BASE: copy.deepcopy(base)}
    folders = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        adapter = make_adapter(base, root / name, seed=30 + seed, **lora)
        merged[name], folders[name] = adapter.merged, adapter.folder
    folders["r32"] = make_adapter(base, root / "r32", seed=9, merge=False, r=32).folder  # above --max-lora-rank 8
    return Made(folders, merged)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (length,), generator=gen).tolist() for _ in range(n)]


@pytest.mark.parametrize("kind", CORES)
async def test_mixed_adapters_in_one_batch_equal_each_merged_adapter_alone(made: Made, kind: str) -> None:
    """Eight requests at once over three adapters and the base model: prompt chunks of 40 tokens, a pool small
    enough to preempt, two slots for three adapters, and two prompts each sent under several adapters (the prefix
    cache is on: a cache that did not key KV by adapter would serve one adapter's prompt KV to another)."""
    shared = prompts(2, 70, seed=1)
    other = prompts(3, 45, seed=2)
    jobs = [
        ("all-r2", shared[0], 10), (BASE, shared[0], 9), ("qvd-r4", shared[0], 12), ("kogu-r8", shared[1], 10),
        ("all-r2", shared[1], 11), (BASE, other[0], 8), ("kogu-r8", other[1], 9), ("qvd-r4", other[2][:5], 12),
    ]  # fmt: skip
    expected = [made.expected(name, prompt, new) for name, prompt, new in jobs]
    engine = await start_engine(kind, tiny_model, made.config())
    try:
        requests = [req(f"j{i}", p, max_new=new, adapter=name) for i, (name, p, new) in enumerate(jobs)]
        outputs = await asyncio.gather(*(run(engine, r) for r in requests))
        stats = engine.stats()
    finally:
        await engine.shutdown()
    for job, (tokens, _), want in zip(jobs, outputs, expected, strict=True):
        assert tokens == want, job[0]
    assert stats.preemptions > 0, "the pool was meant to be small enough to preempt"
    assert stats.lora is not None and stats.lora.slot_writes > 2, "two slots for three adapters: slots are reused"
    assert dict(stats.lora.requests) == {"all-r2": 2, "qvd-r4": 2, "kogu-r8": 2}


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-fused", "cpu-hooks"])
async def test_draft_rows_verify_under_their_sequences_adapter(made: Made, fused: bool, tmp_path: Path) -> None:
    """Speculative decoding beside LoRA: a sequence with k drafts computes k + 1 rows in one step (its last token and
    the drafts), each under its own sequence's adapter, beside base rows and other adapters' rows; every output is
    still its merged adapter's greedy answer. Prompt lookup over repeated phrases (and the loops a random model falls
    into) drafts at most steps; the cost table makes verification free, so the load rule drafts whatever is offered."""
    free = CostTable((1, 64), (0, 8), ((10.0, 10.0), (10.0, 10.0)))
    table = tmp_path / "free.json"
    table.write_text(json.dumps({"rows": table_rows(free)}))
    rng = random.Random(7)
    jobs = []
    for name in ["all-r2", BASE, "qvd-r4", "kogu-r8", "all-r2", BASE]:
        phrase = [rng.randrange(3, 250) for _ in range(rng.randint(3, 6))]
        jobs.append((name, phrase * rng.randint(3, 5), 24))
    expected = [made.expected(name, prompt, new) for name, prompt, new in jobs]
    config = made.config(
        kv_cache_tokens=4096, max_num_batched_tokens=256, max_loras=3, fused_layers=fused,
        speculative="ngram", speculative_cost_table=str(table),
    )  # fmt: skip
    engine = await start_engine("thread", tiny_model, config)
    try:
        requests = [req(f"d{i}", p, max_new=new, adapter=name) for i, (name, p, new) in enumerate(jobs)]
        outputs = await asyncio.gather(*(run(engine, r) for r in requests))
        stats = engine.stats()
    finally:
        await engine.shutdown()
    for job, (tokens, _), want in zip(jobs, outputs, expected, strict=True):
        assert tokens == want, job[0]
    spec = stats.speculation
    assert spec is not None and spec.proposed > 0 and spec.accepted > 0, spec  # drafts were verified, some accepted


@pytest.mark.parametrize("kind", CORES)
async def test_the_prefix_cache_is_per_adapter(made: Made, kind: str) -> None:
    """One prompt under an adapter twice (its prefix KV reused), then under the base model and another adapter: their
    KV is computed anew (none of the first adapter's is served to them), and each output is its own model's."""
    prompt = prompts(1, 60, seed=4)[0]
    engine = await start_engine(kind, tiny_model, made.config(kv_cache_tokens=4096))
    try:
        runs = [await run(engine, req(f"p{i}", prompt, max_new=6, adapter=name)) for i, name in enumerate(
            ["all-r2", "all-r2", BASE, "qvd-r4", BASE]
        )]  # fmt: skip
    finally:
        await engine.shutdown()
    cached = [deltas[-1].usage.cached_prompt_tokens for _, deltas in runs]
    assert cached[1] > 0 and cached[4] > 0, "an adapter's own (and the base model's own) prefix KV is reused"
    assert cached[2] == cached[3] == 0, "KV computed under one adapter served to the base model or another adapter"
    for (tokens, _), name in zip(runs, ["all-r2", "all-r2", BASE, "qvd-r4", BASE], strict=True):
        assert tokens == made.expected(name, prompt, 6)


@pytest.mark.parametrize("kind", CORES)
async def test_a_session_that_switches_adapter_recomputes(made: Made, kind: str) -> None:
    first = prompts(1, 50, seed=3)[0]
    engine = await start_engine(kind, tiny_model, made.config(kv_cache_tokens=4096))
    try:
        out1, _ = await run(engine, req("t1", first, max_new=6, adapter="all-r2", session_id="s"))
        turn2 = first + out1 + [7, 8, 9]
        out2, deltas2 = await run(engine, req("t2", turn2, max_new=6, session_id="s"))  # the base model now
        turn3 = turn2 + out2 + [5]
        out3, deltas3 = await run(engine, req("t3", turn3, max_new=6, adapter="all-r2", session_id="s"))
        out4, deltas4 = await run(engine, req("t4", turn3 + out3, max_new=4, adapter="all-r2", session_id="s"))
    finally:
        await engine.shutdown()
    assert out1 == made.expected("all-r2", first, 6)
    assert out2 == made.expected(BASE, turn2, 6) and deltas2[-1].usage.cached_prompt_tokens == 0
    # Back on the adapter: not the session's KV (the base model's), only the full blocks of turn 1's prompt that the
    # prefix cache holds under this adapter.
    assert out3 == made.expected("all-r2", turn3, 6) and deltas3[-1].usage.cached_prompt_tokens == 48
    # The same adapter again: the session's KV is reused.
    assert out4 == made.expected("all-r2", turn3 + out3, 4) and deltas4[-1].usage.cached_prompt_tokens > 0


@pytest.mark.parametrize("kind", CORES)
async def test_adapter_calls_and_refusals(made: Made, kind: str) -> None:
    config = made.config(
        loras=(("a", str(made.folders["all-r2"])),), max_loras=1, max_cpu_loras=1, kv_cache_tokens=4096
    )
    engine = await start_engine(kind, tiny_model, config)
    try:
        assert engine.adapters is not None and engine.adapters.names == {"a"}
        with pytest.raises(UnknownAdapter):
            await run(engine, req("u", [5, 6, 7], adapter="nope"))
        with pytest.raises(AdapterNotFound, match="no such adapter folder"):
            await engine.manage_adapters(LoadAdapter("b", "/nonexistent"))
        with pytest.raises(AdapterRefused, match="rank 32 is above --max-lora-rank 8"):
            await engine.manage_adapters(LoadAdapter("b", str(made.folders["r32"])))
        with pytest.raises(AdapterExists):
            await engine.manage_adapters(LoadAdapter("a", str(made.folders["qvd-r4"])))
        # A request holds "a" (the only adapter memory holds): loading another is refused, the request goes on.
        long = asyncio.ensure_future(run(engine, req("long", [5, 6, 7], max_new=200, adapter="a")))
        while not (engine.stats().lora and engine.stats().lora.running):
            await asyncio.sleep(0.01)
        with pytest.raises(AdaptersBusy):
            await engine.manage_adapters(LoadAdapter("b", str(made.folders["qvd-r4"])))
        tokens, _ = await long
        assert tokens == made.expected("all-r2", [5, 6, 7], 200)
        answer = await engine.manage_adapters(LoadAdapter("b", str(made.folders["qvd-r4"])))  # "a" leaves memory
        assert answer.loaded is not None and answer.loaded.rank == 4 and engine.adapters.names == {"a", "b"}
        states = {i.name: i.resident for i in (await engine.manage_adapters(ListAdapters())).adapters}
        assert states == {"a": False, "b": True}
        # "a" is read again for the next request that names it (and "b" leaves memory).
        tokens, _ = await run(engine, req("back", [9, 10], max_new=5, adapter="a"))
        assert tokens == made.expected("all-r2", [9, 10], 5)
        assert (await engine.manage_adapters(UnloadAdapter("b"))).draining == 0
        with pytest.raises(UnknownAdapter):
            await engine.manage_adapters(UnloadAdapter("b"))
        assert engine.adapters.names == {"a"}
    finally:
        await engine.shutdown()


async def test_an_engine_without_lora_knows_no_adapter() -> None:
    engine = AsyncEngine(tiny_model("llama"), EngineConfig(kv_cache_tokens=1024))
    await engine.start()
    try:
        assert engine.adapters is None and engine.model_info.max_loras == 0
        with pytest.raises(UnknownAdapter):
            await run(engine, req("x", [5, 6], adapter="a"))
    finally:
        await engine.shutdown()
