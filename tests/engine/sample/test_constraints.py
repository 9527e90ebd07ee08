"""sample/constraints.py: the front end's check (refusals name the field and the library's reason, the cache, the
time bound) and the engine's compile (what the check lets through compiles), and constrained generation checked by
independent validators (jsonschema, re.fullmatch, membership) on a tiny random model that speaks SmolLM2's
vocabulary, greedy and sampled, alone and batched."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "service"))
from harness import tiny_engine  # noqa: E402

from llmserve.engine.frontend.async_engine import AsyncEngine  # noqa: E402
from llmserve.engine.sample.constraints import ConstraintChecker, ConstraintCompiler, Vocabulary  # noqa: E402
from llmserve.engine.sample.masks import TokenMasks  # noqa: E402
from llmserve.engine.types.errors import InvalidRequest  # noqa: E402
from llmserve.engine.types.outputs import Delta, FinishReason  # noqa: E402
from llmserve.engine.types.request import (  # noqa: E402
    ConstraintKind,
    ConstraintSpec,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)

SCHEMA = ConstraintKind.JSON_SCHEMA
COMPLETE = (FinishReason.CONSTRAINT, FinishReason.EOS)
PROMPT = (1, 504, 3374, 8437, 28, 2000, 314)
MAX_NEW = 160


@pytest.fixture(scope="module")
def engine_loop() -> Any:
    """A started engine over the tiny model, on an event loop of its own thread (shared by the module)."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = tiny_engine(in_process=True, max_num_seqs=32)  # in the engine process: test_structured_output.py
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(120)
    yield engine, loop
    asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _run(engine_loop: Any, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, engine_loop[1]).result(300)


async def _generate(engine: AsyncEngine, request: GenerationRequest) -> tuple[list[int], str, Delta]:
    ids: list[int] = []
    text = ""
    async for delta in engine.generate(request):
        ids += delta.token_ids
        text += delta.text
    return ids, text, delta


def _request(rid: str, spec: ConstraintSpec | None, seed: int | None, max_new: int = MAX_NEW) -> GenerationRequest:
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=1.0, seed=seed)
    return GenerationRequest(
        rid, PROMPT, sampling=sampling, stopping=StoppingParams(max_new_tokens=max_new), constraint=spec
    )


def _all(engine_loop: Any, requests: list[GenerationRequest]) -> list[tuple[list[int], str, Delta]]:
    engine = engine_loop[0]

    async def go() -> list[tuple[list[int], str, Delta]]:
        return list(await asyncio.gather(*(_generate(engine, r) for r in requests)))

    out: list[tuple[list[int], str, Delta]] = _run(engine_loop, go())
    return out


# -- checking and compiling ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocabulary(smollm_tokenizer: Any) -> Vocabulary:
    return Vocabulary(smollm_tokenizer, 49152, (2,))


@pytest.fixture(scope="module")
def checker(vocabulary: Vocabulary) -> ConstraintChecker:
    return ConstraintChecker(vocabulary)


@pytest.fixture(scope="module")
def compiler(vocabulary: Vocabulary) -> ConstraintCompiler:
    return ConstraintCompiler(vocabulary)


def check_now(checker: ConstraintChecker, spec: ConstraintSpec) -> None:
    """The check of `spec`, waited for on this thread (the front end awaits `check`)."""
    checker.cache.get(spec).result(60)


def bitmask(states: list[Any]) -> list[list[int]]:
    return TokenMasks.shared().bitmask(states, 49152).tolist()


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (ConstraintSpec(SCHEMA, "{not json"), "is not JSON"),
        (ConstraintSpec(SCHEMA, "[1, 2]"), "must be a JSON object"),
        (ConstraintSpec(SCHEMA, '{"type": "strin"}'), "strin"),
        (ConstraintSpec(SCHEMA, '{"not": {"type": "string"}}'), "not"),
        (ConstraintSpec(SCHEMA, '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (ConstraintSpec(SCHEMA, '{"if": {"type": "string"}, "then": {"minLength": 2}}'), "if"),
        (ConstraintSpec(SCHEMA, '{"type": "string", "format": "hostnamexx"}'), "hostnamexx"),
        (ConstraintSpec(SCHEMA, '{"oneOf": [{"type": "integer"}, {"type": "number"}]}'), "oneOf"),
        (ConstraintSpec(SCHEMA, '{"$ref": "http://example.com/s.json"}'), "http://example.com/s.json"),
        (ConstraintSpec(ConstraintKind.REGEX, "[a-"), "unclosed character class"),
        (ConstraintSpec(ConstraintKind.REGEX, "(a)\\1"), "backreference"),
        (ConstraintSpec(ConstraintKind.GRAMMAR, "start: missing"), "missing"),
    ],
)
def test_a_refused_constraint_names_its_field_and_the_librarys_reason(
    checker: ConstraintChecker, spec: ConstraintSpec, reason: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_now(checker, spec)
    assert err.value.field == spec.field
    assert reason.lower() in err.value.reason.lower(), err.value.reason
    assert "<state>" not in err.value.reason and len(err.value.reason) <= 300


def test_checks_are_cached_per_spec_and_least_recently_used_goes_first(vocabulary: Vocabulary) -> None:
    checker = ConstraintChecker(vocabulary, cache_size=2)
    a, b, c = (ConstraintSpec(ConstraintKind.CHOICE, choices=(x,)) for x in ("a", "b", "c"))
    first = checker.cache.get(a)
    assert checker.cache.get(a) is first and checker.cache.builds == 1
    checker.cache.get(b)
    checker.cache.get(a)  # a is now the most recently used
    checker.cache.get(c)  # evicts b
    assert checker.cache.builds == 3
    assert checker.cache.get(a) is first and checker.cache.builds == 3
    checker.cache.get(b)
    assert checker.cache.builds == 4
    bad = ConstraintSpec(ConstraintKind.REGEX, "(")
    for _ in range(2):  # a refusal is cached too
        with pytest.raises(InvalidRequest):
            check_now(checker, bad)
    assert checker.cache.builds == 5


def test_concurrent_requests_for_one_spec_share_one_compile_and_each_gets_its_own_state(
    vocabulary: Vocabulary, smollm_tokenizer: Any
) -> None:
    compiler = ConstraintCompiler(vocabulary)
    spec = ConstraintSpec(SCHEMA, '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    futures = [compiler.submit(spec) for _ in range(8)]
    assert compiler.cache.builds == 1 and all(f is futures[0] for f in futures)
    # Each request gets its own state: advancing one leaves the others at the start.
    one, two = futures[0].result(60).start(), futures[0].result().start()
    assert one.accept(smollm_tokenizer.encode("{", add_special_tokens=False)[0])
    assert not two.done and bitmask([one]) != bitmask([two])


async def test_a_check_past_the_time_bound_is_refused_and_still_lands_in_the_cache(smollm_tokenizer: Any) -> None:
    # A fresh vocabulary's first choice check builds the library's tokenizer (~0.4 s): never within 1 ns.
    checker = ConstraintChecker(Vocabulary(smollm_tokenizer, 49152, (2,)), timeout_s=1e-9)
    spec = ConstraintSpec(ConstraintKind.CHOICE, choices=("yes", "no"))
    with pytest.raises(InvalidRequest) as err:
        await checker.check(spec)
    assert err.value.field == "constraint.choice.options" and "--constraint-compile-timeout" in err.value.reason
    checker.timeout_s = 60.0
    await checker.check(spec)
    assert checker.cache.builds == 1


# -- generation, checked by independent validators -----------------------------------------------------------

_leaf = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(
        st.one_of(st.text("abcxyz", min_size=1, max_size=5), st.integers(-9, 99)), min_size=1, max_size=4, unique=True
    ).map(lambda v: {"enum": v}),
    st.sampled_from([0, 2, 5]).map(lambda m: {"type": "number", "minimum": -m, "maximum": m + 0.5}),
)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=6), children, min_size=1, max_size=4)
    return props.flatmap(
        lambda p: st.sets(st.sampled_from(sorted(p))).map(
            lambda req: {"type": "object", "properties": p, "required": sorted(req), "additionalProperties": False}
        )
    )


def _arrays(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )


schemas = st.recursive(_leaf, lambda children: st.one_of(_objects(children), _arrays(children)), max_leaves=8)
object_schemas = _objects(schemas)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(object_schemas, min_size=4, max_size=8), seed=st.integers(0, 2**31))
def test_json_schema_outputs_that_finish_validate(engine_loop: Any, batch: list[dict[str, Any]], seed: int) -> None:
    requests = []
    for i, schema in enumerate(batch):
        spec = ConstraintSpec(SCHEMA, json.dumps(schema))
        requests += [_request(f"g{i}", spec, None), _request(f"s{i}", spec, seed + i)]
    for request, (_, text, last) in zip(requests, _all(engine_loop, requests), strict=True):
        schema = json.loads(request.constraint.text)  # type: ignore[union-attr]
        if last.finish_reason in COMPLETE:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert last.finish_reason is FinishReason.LENGTH, last
            assert last.usage is not None and last.usage.completion_tokens == MAX_NEW


def test_json_object_and_schema_outputs_mostly_finish(engine_loop: Any) -> None:
    """The random model finishes most small schemas within the budget (so the test above checks real outputs)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    specs = [ConstraintSpec(SCHEMA, json.dumps(schema))] * 6 + [ConstraintSpec(ConstraintKind.JSON_OBJECT)] * 2
    requests = [_request(f"m{i}", spec, i) for i, spec in enumerate(specs)]
    results = _all(engine_loop, requests)
    finished = 0
    for spec, (_, text, last) in zip(specs, results, strict=True):
        if last.finish_reason in COMPLETE:
            finished += 1
            value = json.loads(text)
            if spec.kind is SCHEMA:
                jsonschema.validate(value, schema)
            else:
                assert isinstance(value, dict)
    assert finished >= 5


_atom = st.one_of(
    st.sampled_from("abcxyz019"),
    st.sampled_from(["[a-f]", "[0-9]", "[xyz]", "[A-C]"]),
)
_piece = st.tuples(_atom, st.sampled_from(["", "?", "{2}", "{1,3}", "{0,2}"])).map("".join)
_sequence = st.lists(_piece, min_size=1, max_size=5).map("".join)
regexes = st.one_of(_sequence, st.tuples(_sequence, _sequence).map(lambda t: f"({t[0]}|{t[1]})"))
regexes = st.lists(regexes, min_size=1, max_size=3).map("".join)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(regexes, min_size=4, max_size=8), seed=st.integers(0, 2**31))
def test_regex_outputs_that_finish_fullmatch(engine_loop: Any, batch: list[str], seed: int) -> None:
    requests = []
    for i, pattern in enumerate(batch):
        spec = ConstraintSpec(ConstraintKind.REGEX, pattern)
        requests += [_request(f"g{i}", spec, None, 40), _request(f"s{i}", spec, seed + i, 40)]
    for request, (_, text, last) in zip(requests, _all(engine_loop, requests), strict=True):
        pattern = request.constraint.text  # type: ignore[union-attr]
        assert last.finish_reason in COMPLETE, (pattern, text, last)  # bounded patterns always finish
        assert re.fullmatch(pattern, text), (pattern, text)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # Characters the vocabulary can spell (see the test below for those it cannot).
    options=st.lists(
        st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs", "Cc")), min_size=1, max_size=12),
        min_size=1,
        max_size=6,
        unique=True,
    ),
    seed=st.integers(0, 2**31),
)
def test_choice_outputs_are_one_of_the_options(engine_loop: Any, options: list[str], seed: int) -> None:
    spec = ConstraintSpec(ConstraintKind.CHOICE, choices=tuple(options))
    requests = [_request("g", spec, None, 64)] + [_request(f"s{i}", spec, seed + i, 64) for i in range(4)]
    for _, text, last in _all(engine_loop, requests):
        assert last.finish_reason in COMPLETE, (options, text, last)
        assert text in options, (options, text)


def test_a_choice_the_vocabulary_cannot_spell_is_refused(checker: ConstraintChecker) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_now(checker, ConstraintSpec(ConstraintKind.CHOICE, choices=("ok", "\U00040000")))
    assert (
        err.value.field == "constraint.choice.options" and "option 1" in err.value.reason and "0xf1" in err.value.reason
    )


def test_the_grammar_kind_takes_lark(engine_loop: Any) -> None:
    grammar = 'start: "answer=" NUMBER ("," NUMBER)?\nNUMBER: /[1-9][0-9]{0,2}/\n'
    requests = [_request(f"l{i}", ConstraintSpec(ConstraintKind.GRAMMAR, grammar), i, 32) for i in range(6)]
    for _, text, last in _all(engine_loop, requests):
        assert last.finish_reason in COMPLETE
        assert re.fullmatch(r"answer=[1-9][0-9]{0,2}(,[1-9][0-9]{0,2})?", text), text


def test_unconstrained_rows_give_the_same_tokens_beside_constrained_ones(engine_loop: Any) -> None:
    plain = [_request(f"p{i}", None, None, 24) for i in range(4)]
    alone = [ids for ids, _, _ in _all(engine_loop, plain)]
    specs = [ConstraintSpec(SCHEMA, '{"type": "object"}'), ConstraintSpec(ConstraintKind.REGEX, "[a-z]{5,20}")]
    mixed = [_request(f"c{i}", specs[i % 2], i, 24) for i in range(6)] + [
        _request(f"q{i}", None, None, 24) for i in range(4)
    ]
    together = _all(engine_loop, mixed)
    assert [ids for ids, _, _ in together[6:]] == alone


def test_a_failing_compile_leaves_the_other_streams_alone(engine_loop: Any) -> None:
    engine = engine_loop[0]
    plain = [_request(f"a{i}", None, None, 24) for i in range(3)]
    alone = [ids for ids, _, _ in _all(engine_loop, plain)]

    async def go() -> tuple[list[Any], BaseException | None]:
        streams = [asyncio.ensure_future(_generate(engine, r)) for r in plain]
        failure = None
        try:
            await _generate(engine, _request("bad", ConstraintSpec(SCHEMA, '{"not": {}}'), None))
        except InvalidRequest as exc:
            failure = exc
        return list(await asyncio.gather(*streams)), failure

    results, failure = _run(engine_loop, go())
    assert isinstance(failure, InvalidRequest) and failure.field == "constraint.json_schema"
    assert [ids for ids, _, _ in results] == alone


def test_ignore_eos_still_ends_a_complete_constraint(engine_loop: Any) -> None:
    request = GenerationRequest(
        "ie",
        PROMPT,
        stopping=StoppingParams(max_new_tokens=50, ignore_eos=True, min_new_tokens=0),
        constraint=ConstraintSpec(ConstraintKind.CHOICE, choices=("yes", "no")),
    )
    _, text, last = _run(engine_loop, _generate(engine_loop[0], request))
    assert text in ("yes", "no") and last.finish_reason is FinishReason.CONSTRAINT


def test_the_sampler_picks_the_best_allowed_token_greedy_and_never_a_forbidden_one(
    compiler: ConstraintCompiler, smollm_tokenizer: Any
) -> None:
    import torch

    from llmserve.engine.sample.sampler import sample
    from llmserve.engine.sample.streams import RandomStreams
    from llmserve.engine.sched.sequence import SampleRow

    compiled = compiler.submit(ConstraintSpec(ConstraintKind.REGEX, "(cat|dog|[0-9]{2})")).result(60)
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0))
    states = [compiled.start() for _ in range(6)]  # one each: the library borrows each matcher once per call
    bits = bitmask(states[:1])[0]
    allowed = [t for t in range(49152) if (bits[t // 32] >> (t % 32)) & 1]  # decoded here, bit by bit
    assert 0 < len(allowed) < 1000
    rows = [
        SampleRow(SamplingParams(), None, 0, [], (), False, 0, constraint=states[0]),
        SampleRow(SamplingParams(), None, 1, [], (), False, 0),  # unconstrained beside it: its own argmax
        SampleRow(SamplingParams(), None, 2, [], tuple(allowed), False, 0, constraint=states[1]),  # all blocked
    ] + [SampleRow(SamplingParams(temperature=1.5), s, s, [], (), False, 0, constraint=states[s]) for s in range(3, 6)]
    ids, _ = sample(logits, rows, RandomStreams())
    assert ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert ids[1] == int(logits[1].argmax())
    assert ids[2] == max(allowed, key=lambda t: logits[2, t].item()), "blocked ids give way, the constraint does not"
    assert all(t in allowed for t in ids[3:])


@pytest.mark.real_model
def test_the_default_model_answers_within_its_constraints(real_model: Any) -> None:
    """SmolLM2-135M-Instruct asked in chat for a schema, a date and a label: greedy and sampled answers validate."""
    from llmserve.engine.config import EngineConfig

    tok = real_model.tokenizer
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "languages": {"type": "array", "items": {"enum": ["en", "fr", "es", "de"]}, "maxItems": 3},
        },
        "required": ["name", "age", "languages"],
        "additionalProperties": False,
    }
    asks = [
        ("Describe a French teacher as JSON with name, age and languages.", ConstraintSpec(SCHEMA, json.dumps(schema))),
        (
            "When did the Berlin wall fall? Answer with a date.",
            ConstraintSpec(ConstraintKind.REGEX, r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        ),
        ("Is the sky green? Answer yes or no.", ConstraintSpec(ConstraintKind.CHOICE, choices=("yes", "no"))),
    ]

    def prompt(question: str) -> tuple[int, ...]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        return tuple(tok.encode(text, add_special_tokens=False))

    requests = []
    for i, (question, spec) in enumerate(asks):
        for seed in (None, 7):
            sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.7, seed=seed)
            stopping = StoppingParams(max_new_tokens=80)
            requests.append(GenerationRequest(f"r{i}-{seed}", prompt(question), sampling, stopping, constraint=spec))

    async def go() -> list[tuple[list[int], str, Delta]]:
        engine = AsyncEngine(real_model, EngineConfig(kv_cache_tokens=4096, max_num_seqs=8, cuda_graphs=False))
        await engine.start()
        try:
            return list(await asyncio.gather(*(_generate(engine, r) for r in requests)))
        finally:
            await engine.shutdown()

    results = asyncio.run(go())
    for request, (_, text, last) in zip(requests, results, strict=True):
        spec = request.constraint
        assert spec is not None
        assert last.finish_reason in COMPLETE, (request.request_id, text, last)
        if spec.kind is SCHEMA:
            jsonschema.validate(json.loads(text), schema)
        elif spec.kind is ConstraintKind.REGEX:
            assert re.fullmatch(spec.text, text), text
        else:
            assert text in spec.choices


_NASTY = [
    "true",
    "false",
    "{}",
    '{"type": 5}',
    '{"properties": []}',
    '{"$ref": "#/nowhere"}',
    "[" * 20000 + "]" * 20000,
    '{"a":' * 5000 + "1" + "}" * 5000,
    '{"type": "string", "pattern": "(("}',
    '{"type": "integer", "minimum": 5, "maximum": 1}',
    '{"enum": []}',
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from([SCHEMA, ConstraintKind.REGEX, ConstraintKind.GRAMMAR]),
    text=st.one_of(st.sampled_from(_NASTY), st.text(max_size=60), st.text("[](){}|*+?\\^$.:\"'/ab01", max_size=40)),
)
def test_any_text_is_refused_naming_the_field_or_compiles(
    checker: ConstraintChecker, compiler: ConstraintCompiler, kind, text
) -> None:  # noqa: ANN001
    """What the front end's check lets through, the engine compiles (the two never disagree)."""
    spec = ConstraintSpec(kind, text)
    try:
        check_now(checker, spec)
    except InvalidRequest as exc:
        assert exc.field == f"constraint.{kind.value}"
        return
    compiler.submit(spec).result(60).start()  # a checked spec compiles, and starts
