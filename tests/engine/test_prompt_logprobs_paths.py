"""Prompt logprobs in the engine: the prompt chunks of a request that asks keep logits at every position, scored in the
backend, and come with its first delta, equal to log_softmax of transformers' logits of the same weights. The same
answer on the fused CPU forward and transformers' layers, with overlapped steps (--async-scheduling), with speculative
decoding verifying drafts of a stream in the same steps, and with LoRA serving on; prompts read in several chunks;
generation beside them unchanged token for token; n > 1 scores the prompt once. The tiny Llama in float32."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.spec.policy import CostTable
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.outputs import Delta
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import table_rows
from tests.testing import tiny_config

# A budget of 64 tokens a step: a prompt of 150 is read in three chunks.
CONFIG = EngineConfig(block_size=16, kv_cache_tokens=8192, max_num_seqs=8, max_num_batched_tokens=64)
FREE = CostTable((1, 64), (0, 8), ((10.0, 10.0), (10.0, 10.0)))  # drafts cost nothing: verify all that is offered
TOLERANCE = 1e-4
TOP = 3


def tiny() -> LoadedModel:
    return from_config(tiny_config(max_positions=512), dtype=torch.float32)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny()


@pytest.fixture(scope="module")
def reference_model() -> Any:
    """The same weights (the same seed) in a model of their own, with transformers' attention."""
    return tiny().model


def reference(model: Any, prompt: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def prompt(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 500) for _ in range(length))


SCORED = [prompt(150, 1), prompt(40, 2)]
# A stream that repeats itself, so that prompt lookup (speculation) drafts for it while the scored prompts are read.
LOOP = tuple(list(range(20, 36)) * 4)


def scored(rid: str, ids: tuple[int, ...], **kw: Any) -> GenerationRequest:
    stopping = StoppingParams(max_new_tokens=6, ignore_eos=True)
    return GenerationRequest(rid, ids, stopping=stopping, prompt_logprobs=True, prompt_top_logprobs=TOP, **kw)


async def collect(engine: AsyncEngine, request: GenerationRequest) -> list[Delta]:
    async with asyncio.timeout(60):
        return [delta async for delta in engine.generate(request)]


async def serve_all(
    loaded: LoadedModel, config: EngineConfig, stats: list[Any] | None = None
) -> tuple[list[list[Delta]], list[Delta]]:
    """The scored requests and the looping stream at once; each one's deltas (and into `stats`, the engine's
    speculation counters)."""
    engine = AsyncEngine(loaded, config)
    await engine.start()
    try:
        loop = GenerationRequest("loop", LOOP, stopping=StoppingParams(max_new_tokens=64, ignore_eos=True))
        results = await asyncio.gather(
            collect(engine, loop), *(collect(engine, scored(f"s{i}", p)) for i, p in enumerate(SCORED))
        )
        if stats is not None:
            stats.append(engine.stats().speculation)
    finally:
        await engine.shutdown()
    return list(results[1:]), results[0]


def check(deltas: list[Delta], ids: tuple[int, ...], model: Any) -> None:
    want = reference(model, ids)
    got = deltas[0].prompt_logprobs
    assert got is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    assert [lp.token_id for lp in got] == list(ids[1:])
    values = torch.tensor([lp.logprob for lp in got])
    assert (values - want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).abs().max().item() <= TOLERANCE
    top = want.topk(TOP, dim=-1)
    assert [[t for t, _ in lp.top] for lp in got] == top.indices.tolist()
    assert (torch.tensor([[v for _, v in lp.top] for lp in got]) - top.values).abs().max().item() <= TOLERANCE
    assert deltas[-1].usage is not None and deltas[-1].usage.cached_prompt_tokens == 0


def tokens(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.fixture(scope="module")
def plain(loaded: LoadedModel) -> tuple[list[list[Delta]], list[Delta]]:
    return asyncio.run(serve_all(loaded, CONFIG))


def test_prompt_logprobs_equal_transformers_over_chunks(plain: tuple, reference_model: Any) -> None:
    for deltas, ids in zip(plain[0], SCORED, strict=True):
        check(deltas, ids, reference_model)


async def test_generation_beside_them_is_unchanged(loaded: LoadedModel, plain: tuple) -> None:
    engine = AsyncEngine(loaded, CONFIG)
    await engine.start()
    try:
        alone = await collect(engine, GenerationRequest("loop", LOOP, stopping=StoppingParams(64, ignore_eos=True)))
    finally:
        await engine.shutdown()
    assert tokens(plain[1]) == tokens(alone)
    assert all(d.prompt_logprobs is None for d in plain[1])


@pytest.mark.parametrize("setting", ["transformers layers", "overlap", "speculation", "lora"])
async def test_the_same_answer_on_every_path(
    setting: str, loaded: LoadedModel, plain: tuple, reference_model: Any, tmp_path: Path
) -> None:
    overrides: dict[str, Any] = {
        "transformers layers": dict(fused_layers=False),
        "overlap": dict(async_scheduling=True),
        "lora": dict(enable_lora=True, max_lora_rank=8),
    }.get(setting, {})
    if setting == "speculation":
        table = tmp_path / "free.json"
        table.write_text(json.dumps({"rows": table_rows(FREE)}))
        overrides = dict(speculative="ngram", speculative_cost_table=str(table))
    engine_loaded = tiny() if setting == "lora" else loaded  # LoRA hooks the model's projections: a model of its own
    stats: list[Any] = []
    got, loop = await serve_all(engine_loaded, dataclasses.replace(CONFIG, **overrides), stats)
    if setting == "speculation":
        assert stats[0].proposed > 0 and stats[0].accepted > 0, stats  # drafts were verified beside the prompts
    for deltas, ids, before in zip(got, SCORED, plain[0], strict=True):
        check(deltas, ids, reference_model)
        assert tokens(deltas) == tokens(before)
    assert tokens(loop) == tokens(plain[1])


async def test_n_completions_score_the_prompt_once(loaded: LoadedModel, reference_model: Any) -> None:
    engine = AsyncEngine(loaded, CONFIG)
    await engine.start()
    try:
        deltas = await collect(engine, scored("n", SCORED[1], n=3))
    finally:
        await engine.shutdown()
    assert deltas[0].index == 0
    check([d for d in deltas if d.index == 0], SCORED[1], reference_model)
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert {d.index for d in deltas} == {0, 1, 2}


@pytest.mark.real_model
async def test_the_gguf_blocks_score_a_prompt_as_they_pick_its_next_tokens() -> None:
    """The default model (SmolLM2's GGUF blocks, float32 activations; every token's attention through the decode
    kernel, so that a row's result does not depend on the chunk that computed it): the distribution a prompt chunk
    scores at position k is the one a request for prompt[:k + 1] samples its first token from."""
    from llmserve.models.loader import load_model

    loaded = load_model()
    assert loaded.weights == "gguf"
    engine = AsyncEngine(loaded, dataclasses.replace(CONFIG, max_num_batched_tokens=16))
    await engine.start()
    try:
        text = "The quick brown fox jumps over the lazy dog because it was in a hurry to get home before the rain."
        ids = tuple(loaded.tokenizer.encode(text))
        assert len(ids) > 16  # two chunks
        one = StoppingParams(max_new_tokens=1, ignore_eos=True)
        request = GenerationRequest("p", ids, stopping=one, prompt_logprobs=True, prompt_top_logprobs=5)
        got = (await collect(engine, request))[0].prompt_logprobs
        assert got is not None and [lp.token_id for lp in got] == list(ids[1:])
        for k in (2, 9, 17, len(ids) - 2):
            prefix = GenerationRequest(f"k{k}", ids[: k + 1], stopping=one, logprobs=True, top_logprobs=5)
            logprobs = (await collect(engine, prefix))[0].logprobs
            assert logprobs is not None
            assert [t for t, _ in got[k].top] == [t for t, _ in logprobs[0].top]
            assert [v for _, v in got[k].top] == pytest.approx([v for _, v in logprobs[0].top], abs=1e-5)
    finally:
        await engine.shutdown()
