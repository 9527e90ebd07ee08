"""A corpus of real-world JSON schemas (tests/data/schema_corpus.json: Kubernetes objects, package manifests, API
payloads, function-call parameters): which compile, and whether every finished answer validates (jsonschema),
on the tiny random model and on the default model."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "service"))
from harness import tiny_engine  # noqa: E402

from llmserve.engine.frontend.async_engine import AsyncEngine  # noqa: E402
from llmserve.engine.sample.constraints import ConstraintChecker, ConstraintCompiler, Vocabulary  # noqa: E402
from llmserve.engine.types.errors import InvalidRequest  # noqa: E402
from llmserve.engine.types.outputs import FinishReason  # noqa: E402
from llmserve.engine.types.request import (  # noqa: E402
    ConstraintKind,
    ConstraintSpec,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)

CORPUS: dict[str, Any] = json.loads((Path(__file__).resolve().parents[2] / "data" / "schema_corpus.json").read_text())
REFUSED = {"unenforceable_unique_tags": "uniqueItems", "unenforceable_if_then": "if"}


def _check_all(checker: ConstraintChecker) -> tuple[dict[str, ConstraintSpec], dict[str, str]]:
    served, refused = {}, {}
    for name, schema in CORPUS.items():
        spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        try:
            checker.cache.get(spec).result(60)
            served[name] = spec
        except InvalidRequest as exc:
            assert exc.field == "constraint.json_schema"
            refused[name] = exc.reason
    return served, refused


def test_the_corpus_is_served_and_what_cannot_be_enforced_is_refused(smollm_tokenizer: Any) -> None:
    """The front end refuses what cannot be enforced; the engine compiles every schema it lets through."""
    assert len(CORPUS) >= 50
    vocabulary = Vocabulary(smollm_tokenizer, 49152, (2,))
    served, refused = _check_all(ConstraintChecker(vocabulary))
    assert set(refused) == set(REFUSED), refused
    for name, keyword in REFUSED.items():
        assert keyword in refused[name], refused[name]
    assert len(served) == len(CORPUS) - len(REFUSED)
    compiler = ConstraintCompiler(vocabulary)
    for spec in served.values():
        compiler.submit(spec).result(60)


async def _answers(engine: AsyncEngine, requests: list[GenerationRequest]) -> list[tuple[str, FinishReason | None]]:
    async def one(request: GenerationRequest) -> tuple[str, FinishReason | None]:
        text, reason = "", None
        async for delta in engine.generate(request):
            text += delta.text
            reason = delta.finish_reason
        return text, reason

    return list(await asyncio.gather(*(one(r) for r in requests)))


def _check(results: list[tuple[str, FinishReason | None]], names: list[str]) -> int:
    """Every finished answer validates; returns how many finished."""
    finished = 0
    for name, (text, reason) in zip(names, results, strict=True):
        if reason in (FinishReason.CONSTRAINT, FinishReason.EOS):
            finished += 1
            jsonschema.validate(json.loads(text), CORPUS[name])
        else:
            assert reason is FinishReason.LENGTH, (name, reason)
    return finished


def test_every_finished_answer_of_the_tiny_model_validates() -> None:
    async def go() -> tuple[list[str], list[tuple[str, FinishReason | None]]]:
        engine = tiny_engine(in_process=True, max_num_seqs=64)
        await engine.start()
        try:
            assert engine.checker is not None
            served, _ = _check_all(engine.checker)
            names, requests = [], []
            for name, spec in served.items():
                for seed in range(2):
                    names.append(name)
                    sampling = SamplingParams(temperature=1.0, seed=seed)
                    stopping = StoppingParams(max_new_tokens=160)
                    requests.append(
                        GenerationRequest(f"{name}-{seed}", (1, 2000, 28), sampling, stopping, constraint=spec)
                    )
            return names, await _answers(engine, requests)
        finally:
            await engine.shutdown()

    names, results = asyncio.run(go())
    finished = _check(results, names)
    print(f"tiny model: {finished} of {len(names)} corpus answers finished within 160 tokens, all valid")
    assert finished >= 5  # the random model rambles inside strings: most run out of tokens


@pytest.mark.real_model
def test_every_finished_answer_of_the_default_model_validates(real_model: Any) -> None:
    from llmserve.engine.config import EngineConfig

    tok = real_model.tokenizer

    async def go() -> tuple[list[str], list[tuple[str, FinishReason | None]]]:
        engine = AsyncEngine(real_model, EngineConfig(kv_cache_tokens=32768, max_num_seqs=64, cuda_graphs=False))
        await engine.start()
        try:
            assert engine.checker is not None
            served, _ = _check_all(engine.checker)
            names, requests = [], []
            for name, spec in served.items():
                ask = f"Write one realistic example of a {name.replace('_', ' ')} as JSON."
                text = tok.apply_chat_template(
                    [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
                )
                prompt = tuple(tok.encode(text, add_special_tokens=False))
                names.append(name)
                requests.append(
                    GenerationRequest(name, prompt, stopping=StoppingParams(max_new_tokens=192), constraint=spec)
                )
            return names, await _answers(engine, requests)
        finally:
            await engine.shutdown()

    names, results = asyncio.run(go())
    finished = _check(results, names)
    print(f"default model: {finished} of {len(names)} corpus answers finished within 192 tokens, all valid")
    assert finished >= len(names) // 3
