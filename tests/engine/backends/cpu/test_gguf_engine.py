"""A GGUF's blocks through the whole engine (`--dtype gguf` on the CPU): speculative decoding gives the tokens
without it, n completions share the prompt, a LoRA adapter's float deltas apply on the quantized base (its rows
alone as among base rows), the host KV tier reloads a returning prompt, a JSON-schema constraint holds on the
default model served from its file."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.spec.policy import CostTable
from llmserve.engine.types.request import ConstraintKind, ConstraintSpec, GenerationRequest, StoppingParams
from llmserve.models.loader import from_config, load_model
from tests.engine.engine_helpers import inner, table_rows
from tests.engine.lora.peft_adapters import make_adapter
from tests.gguf_helpers import Q, gguf_loaded, write_llama_gguf
from tests.testing import TINY_VOCAB, tiny_config

FREE = CostTable((1, 64), (0, 8), ((10.0, 10.0), (10.0, 10.0)))  # drafts cost nothing: verify all that is offered


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(the float model the file was written from, the file's path)."""
    source = from_config(tiny_config("llama"), dtype=torch.float32, seed=5).model
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path, source, {"blk.0.attn_v.weight": Q.Q4_1})
    return source, path


def loaded(tiny: tuple[Any, Path]) -> Any:
    return gguf_loaded(tiny[1], tiny[0].config)


async def collect(engine: AsyncEngine, request: GenerationRequest) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async with asyncio.timeout(120):
        async for delta in engine.generate(request):
            out.setdefault(delta.index, []).extend(delta.token_ids)
    return out


async def serve(model: Any, config: EngineConfig, requests: list[GenerationRequest]) -> tuple[list, Any]:
    engine = AsyncEngine(model, config)
    await engine.start()
    try:
        results = list(await asyncio.gather(*(collect(engine, r) for r in requests)))
        return results, inner(engine)
    finally:
        await engine.shutdown()


def request(rid: str, prompt: list[int], new: int = 16, **kw: Any) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), stopping=StoppingParams(new, ignore_eos=True), **kw)


async def test_speculation_gives_the_tokens_without_it(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    table = tmp_path / "free.json"
    table.write_text(json.dumps({"rows": table_rows(FREE)}))
    rng = random.Random(3)
    motif = [rng.randrange(TINY_VOCAB) for _ in range(12)]
    prompts = [motif * 4 + [rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (3, 9, 17)]  # repeats to look up
    requests = [request(f"s{i}", p, 24) for i, p in enumerate(prompts)]
    base = EngineConfig(kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=256)
    plain, _ = await serve(loaded(tiny), base, requests)
    spec_config = EngineConfig(
        kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=256, speculative="ngram",
        speculative_cost_table=str(table),
    )  # fmt: skip
    drafted, core = await serve(loaded(tiny), spec_config, requests)
    assert drafted == plain
    speculation = core.stats().speculation
    assert speculation is not None and speculation.accepted > 0, speculation


async def test_n_completions_and_the_host_kv_tier(tiny: tuple[Any, Path]) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(100)]
    config = EngineConfig(kv_cache_tokens=256, max_num_seqs=8, max_num_batched_tokens=64, kv_offload_bytes=64 << 20)
    from llmserve.engine.types.request import SamplingParams

    sampled = GenerationRequest("n", tuple(prompt), SamplingParams(temperature=1.0, seed=7), StoppingParams(8), n=3)
    others = [request(f"o{i}", [rng.randrange(TINY_VOCAB) for _ in range(120)], 4) for i in range(3)]  # evict
    again = request("again", prompt, 8)
    engine = AsyncEngine(loaded(tiny), config)
    await engine.start()
    try:
        fanned = await collect(engine, sampled)
        first = await collect(engine, request("first", prompt, 8))
        for other in others:
            await collect(engine, other)
        second = await collect(engine, again)
        stats = inner(engine).stats()
    finally:
        await engine.shutdown()
    assert sorted(fanned) == [0, 1, 2] and all(len(t) == 8 for t in fanned.values())
    assert second == first
    assert stats.kv_tiers is not None and sum(t.loaded_blocks for t in stats.kv_tiers.tiers.values()) > 0, stats


async def test_a_lora_adapter_applies_on_the_quantized_base(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    adapter = make_adapter(tiny[0], tmp_path / "a", seed=11, merge=False, r=4, lora_alpha=8)
    config = EngineConfig(
        kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=128, loras=(("a", str(adapter.folder)),),
        max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    rng = random.Random(8)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (30, 70, 12)]
    alone = []
    for i, p in enumerate(prompts):
        results, _ = await serve(loaded(tiny), config, [request(f"a{i}", p, adapter="a")])
        alone.append(results[0])
    mixed = [request(f"m{i}", p, adapter="a") for i, p in enumerate(prompts)]
    mixed += [request(f"b{i}", p) for i, p in enumerate(prompts)]
    together, core = await serve(loaded(tiny), config, mixed)
    assert core.backend.fused is not None and core.backend.fused.precision.linears == "gguf-float32"
    assert together[:3] == alone  # an adapter row computes the same beside base rows
    assert together[3:] != together[:3], "the adapter changed nothing"


@pytest.mark.real_model
async def test_a_json_schema_holds_on_the_default_model_from_its_blocks(tmp_path: Path) -> None:
    model = load_model(None, device="cpu", dtype="gguf", cache_root=tmp_path)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tok = model.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name a city as JSON."}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    constraint = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    r = GenerationRequest("j", tuple(prompt), stopping=StoppingParams(48), constraint=constraint)
    (out,), _ = await serve(model, EngineConfig(kv_cache_tokens=2048, max_num_seqs=4), [r])
    value = json.loads(tok.decode(out[0], skip_special_tokens=True))
    assert isinstance(value["city"], str)
