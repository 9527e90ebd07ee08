"""Speculative decoding changes nothing a caller sees but the speed: the same engine with and without it, token for
token, with the same usage, finish reasons and session KV.

Tiny random-weight models (float64 where no tokenizer is needed, so equality is exact; the SmolLM2 vocabulary in
float32 for stop strings and constraints). Greedy random models fall into loops quickly, which prompt lookup
catches, so most steps verify drafts; every test checks that drafts were verified and some accepted, so that a
speculation that silently turned itself off would fail it. The cost table given to the engine makes verification
free, so the load rule drafts whenever the proposer offers something.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.spec.policy import CostTable
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import (
    ConstraintKind,
    ConstraintSpec,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import table_rows
from tests.testing import TINY_VOCAB, tiny_config

FREE = CostTable((1, 64), (0, 8), ((10.0, 10.0), (10.0, 10.0)))  # drafts cost nothing: verify all that is offered


@pytest.fixture(scope="module")
def free_table(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("spec") / "free.json"
    path.write_text(json.dumps({"rows": table_rows(FREE)}))
    return str(path)


def tiny64() -> LoadedModel:
    return from_config(tiny_config("llama"), dtype=torch.float64)


def config(spec: str, table: str, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(kv_cache_tokens=16384, max_num_seqs=16, max_num_batched_tokens=512)
    settings.update(overrides)
    if spec != "off":
        settings.update(speculative=spec, speculative_cost_table=table)
    return EngineConfig(**settings)


async def serve(loaded: LoadedModel, cfg: EngineConfig, requests: list[GenerationRequest]) -> tuple[list, Any]:
    """Every request at once through the engine; per request its tokens, logprobs and final delta; and the
    engine's speculation counters."""
    engine = AsyncEngine(loaded, cfg)
    await engine.start()

    async def one(request: GenerationRequest) -> list[tuple[list[int], list, Any]]:
        completions: dict[int, tuple[list[int], list, list]] = {}
        async for delta in engine.generate(request):
            tokens, logprobs, final = completions.setdefault(delta.index, ([], [], []))
            tokens.extend(delta.token_ids)
            logprobs.extend(delta.logprobs or [])
            if delta.finished:
                final.append(delta)
        return [(t, lp, f[0]) for _, (t, lp, f) in sorted(completions.items())]

    try:
        results = await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), timeout=240)
        stats = engine.stats().speculation
    finally:
        await engine.shutdown()
    return [c for completions in results for c in completions], stats


def compare(loaded: LoadedModel, table: str, requests: list[GenerationRequest], spec: str = "ngram", **kw: Any) -> Any:
    plain, none = asyncio.run(serve(loaded, config("off", table, **kw), requests))
    fast, stats = asyncio.run(serve(loaded, config(spec, table, **kw), requests))
    assert none is None
    for (tokens, logprobs, final), (s_tokens, s_logprobs, s_final) in zip(plain, fast, strict=True):
        assert s_tokens == tokens
        assert s_final.finish_reason == final.finish_reason
        assert s_final.usage == final.usage
        assert len(s_logprobs) == len(logprobs)
        for a, b in zip(logprobs, s_logprobs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert stats.proposed > 0 and stats.accepted > 0, stats  # speculation ran, and paid somewhere
    return plain, stats


def prompts(n: int, seed: int, repeat: bool) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if repeat and i % 2 == 0:
            phrase = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(3, 8))]
            out.append(phrase * rng.randint(3, 6))
        else:
            out.append([rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 60))])
    return out


def test_greedy_with_speculation_is_greedy_without_under_concurrency(free_table: str) -> None:
    loaded = tiny64()
    requests = [
        GenerationRequest(f"r{i}", tuple(p), stopping=StoppingParams(max_new_tokens=40 + 7 * i, ignore_eos=True))
        for i, p in enumerate(prompts(8, 1, repeat=True))
    ]
    _, stats = compare(loaded, free_table, requests)
    assert stats.emitted > stats.verifying  # some steps emitted more than one token
    # One at a time too, where every step verifies at batch 1.
    compare(loaded, free_table, requests[:1])


def test_stop_tokens_eos_and_max_new_tokens_end_where_they_would(free_table: str) -> None:
    loaded = tiny64()
    base = prompts(6, 2, repeat=True)
    plain, _ = asyncio.run(
        serve(
            loaded,
            config("off", free_table),
            [GenerationRequest("probe", tuple(base[0]), stopping=StoppingParams(max_new_tokens=40, ignore_eos=True))],
        )
    )
    answer = plain[0][0]
    stop_id = answer[len(answer) // 2]  # a token the answer reaches mid-way, inside a drafted run or not
    requests = [
        GenerationRequest(
            "stop", tuple(base[0]), stopping=StoppingParams(max_new_tokens=40, stop_token_ids=(stop_id,))
        ),
        GenerationRequest("short", tuple(base[2]), stopping=StoppingParams(max_new_tokens=3, ignore_eos=True)),
        GenerationRequest("one", tuple(base[4]), stopping=StoppingParams(max_new_tokens=1, ignore_eos=True)),
        GenerationRequest(
            "min",
            tuple(base[0]),
            stopping=StoppingParams(max_new_tokens=30, min_new_tokens=25, stop_token_ids=(stop_id,)),
        ),
        GenerationRequest("eos", tuple(base[2]), stopping=StoppingParams(max_new_tokens=60)),
    ]
    # Two requests share each prompt: whether the second finds the first's blocks in the prefix cache depends on
    # whether the step thread ran between their submissions, so each run could report other cached tokens in its
    # usage. Without the cache both runs compute every prompt, and usage compares what this test is about.
    out, _ = compare(loaded, free_table, requests, enable_prefix_caching=False)
    assert out[0][2].finish_reason.name == "STOP_TOKEN" and out[0][0][-1] == stop_id
    assert len(out[1][0]) == 3 and len(out[2][0]) == 1


def test_seeded_sampling_replays_with_speculation_and_logprobs_match(free_table: str) -> None:
    loaded = tiny64()
    requests = []
    # A random model's next-token distribution is nearly flat: sampled answers would not repeat, and nothing could
    # be drafted. Top-k 1 and 2 keep the sampled path (streams, draws, the rejection rule) while answers still loop.
    for i, p in enumerate(prompts(6, 3, repeat=True)):
        params = SamplingParams(
            temperature=0.5 + 0.1 * i,
            top_k=1 + i % 2,
            top_p=0.95,
            seed=100 + i,
            repetition_penalty=1.0 if i % 3 else 1.1,
        )
        stopping = StoppingParams(max_new_tokens=40, ignore_eos=True)
        requests.append(GenerationRequest(f"s{i}", tuple(p), params, stopping, logprobs=True, top_logprobs=2))
    compare(loaded, free_table, requests)


def test_n_completions_and_a_session_keep_what_they_would(free_table: str) -> None:
    loaded = tiny64()
    p = prompts(2, 4, repeat=True)
    n3 = GenerationRequest(
        "n",
        tuple(p[0]),
        SamplingParams(temperature=0.8, top_k=2, seed=5),
        StoppingParams(max_new_tokens=30, ignore_eos=True),
        n=3,
    )
    compare(loaded, free_table, [n3])

    def two_turns(spec: str) -> tuple[list[int], list[int], int]:
        async def go() -> tuple[list[int], list[int], int]:
            engine = AsyncEngine(loaded, config(spec, free_table))
            await engine.start()
            try:
                first = GenerationRequest(
                    "t1", tuple(p[0]), stopping=StoppingParams(max_new_tokens=25, ignore_eos=True), session_id="conv"
                )
                a = [t async for d in engine.generate(first) for t in d.token_ids]
                follow = tuple(p[0]) + tuple(a) + (7, 8, 9)
                second = GenerationRequest(
                    "t2", follow, stopping=StoppingParams(max_new_tokens=25, ignore_eos=True), session_id="conv"
                )
                b = []
                cached = 0
                async for d in engine.generate(second):
                    b.extend(d.token_ids)
                    if d.usage is not None:
                        cached = d.usage.cached_prompt_tokens
                return a, b, cached
            finally:
                await engine.shutdown()

        return asyncio.run(go())

    assert two_turns("ngram") == two_turns("off")  # same answers, and the second turn reused as many tokens


def test_a_proposer_that_is_always_wrong_costs_no_token(free_table: str) -> None:
    loaded = tiny64()
    request = GenerationRequest(
        "w", tuple(prompts(1, 5, repeat=True)[0]), stopping=StoppingParams(max_new_tokens=24, ignore_eos=True)
    )

    def run(spec: str, wrong: bool) -> tuple[list[int], int]:
        core = EngineCore(loaded, config(spec, free_table))
        if wrong:
            assert core.speculation is not None

            class Wrong:
                def propose(self, key: int, tokens: Any, k: int | None = None) -> list[int]:
                    return [(tokens[-1] + 1 + j) % TINY_VOCAB for j in range(k or 4)]

            core.speculation.drafter.proposer = Wrong()
            core.speculation.drafter._suffix = None
        core.submit(request)
        tokens: list[int] = []
        steps = 0
        while core.scheduler.has_work or not tokens:
            core.drain_inbox()
            core.step()
            steps += 1
            tokens.extend(t for out in core.take_outputs() for t in out.token_ids)
        return tokens, steps

    plain, plain_steps = run("off", False)
    wrong, wrong_steps = run("ngram", True)
    assert wrong == plain and wrong_steps == plain_steps  # one token per step, nothing lost


@pytest.mark.parametrize("spec", ["ngram", "suffix"])
def test_stop_strings_and_json_constraints_with_a_tokenizer(free_table: str, spec: str, smollm_tokenizer: Any) -> None:
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    llama = LlamaConfig(vocab_size=49152, num_key_value_heads=2, max_position_embeddings=1024, **shape)
    loaded = from_config(llama, tokenizer=smollm_tokenizer, dtype=torch.float32, seed=0)  # random weights
    tok = loaded.tokenizer
    text = "Rewrite: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."
    ids = tuple(tok.encode(text))
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    constraint = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    probe, _ = asyncio.run(
        serve(
            loaded,
            config("off", free_table),
            [GenerationRequest("p", ids, stopping=StoppingParams(max_new_tokens=40, ignore_eos=True))],
        )
    )
    stop = tok.decode(probe[0][0][10:12])  # text the answer reaches, so the stop string cuts it
    requests = [
        GenerationRequest(
            "stop", ids, stopping=StoppingParams(max_new_tokens=40, ignore_eos=True, stop_sequences=(stop,))
        ),
        GenerationRequest("json", ids, stopping=StoppingParams(max_new_tokens=80), constraint=constraint),
        GenerationRequest(
            "json-s",
            ids,
            SamplingParams(temperature=0.8, seed=9),
            StoppingParams(max_new_tokens=80),
            constraint=constraint,
        ),
    ]
    out, _ = compare(loaded, free_table, requests, spec=spec, max_num_seqs=8)
    assert out[0][2].finish_reason.name == "STOP_SEQUENCE"
    json.loads(tok.decode(out[1][0]))
