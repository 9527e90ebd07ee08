"""The engine's asyncio front end (AsyncEngine with its output processor) over either core (core/client.Core: on a
thread, or in an engine process): seeds, validation, cancellation, failures, deadlines, coalescing, the waiting
count, session queries however the core ends, a core's death, text and stop strings.

Every test that needs only the interface runs over both cores (the `engine` fixture: one engine per core per
module); the tests that reach into the core's books (a spy on its steps, a planted failure) run on the thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import llguidance
import pytest
import pytest_asyncio
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.frontend.output_processor import OutputProcessor
from llmserve.engine.types.errors import EngineDead, InvalidRequest, QueueFull
from llmserve.engine.types.kv_cache import KvStored
from llmserve.engine.types.outputs import FinishReason, Usage
from llmserve.engine.types.request import (
    ConstraintKind,
    ConstraintSpec,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import (
    CONFIG,
    CORES,
    RUN_TIMEOUT_S,
    PieceTokenizer,
    inner,
    kill_core,
    req,
    run,
    start_engine,
    with_text,
)
from tests.stepspy import StepSpy
from tests.testing import greedy_reference, tiny_config

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=CORES)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    """One started engine per core for the module's tests that leave it as they found it."""
    eng = await start_engine(request.param)
    yield eng
    await eng.shutdown()


# A pool of 31 blocks of 16 (496 tokens), one sequence at a time, two waiting at most, prompts computed 16 tokens a
# step: for the tests of admission and of the waiting count.
SMALL = EngineConfig(block_size=16, kv_cache_tokens=496, max_num_seqs=1, max_waiting=2, max_num_batched_tokens=16)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=CORES)
async def small(request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    eng = await start_engine(request.param, config=SMALL)
    yield eng
    await eng.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def thread_engine() -> AsyncIterator[AsyncEngine]:
    """An engine of its own over a core on a thread, for a test that reaches into the core's books."""
    eng = await start_engine("thread")
    yield eng
    await eng.shutdown()


async def wait_for(predicate, timeout: float = RUN_TIMEOUT_S) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_seeded_sampling_is_the_same_alone_and_in_any_batch(engine: AsyncEngine) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    prompt = list(range(3, 40))
    alone, _ = await run(engine, req("alone", prompt, sampling=sampling))
    others = [
        req(f"o{i}", list(range(i, i + 5 + 7 * i)), sampling=SamplingParams(temperature=1.0, seed=i)) for i in range(7)
    ]
    results = await asyncio.gather(
        run(engine, req("batched", prompt, sampling=sampling)), *(run(engine, o) for o in others)
    )
    assert results[0][0] == alone
    different_seed, _ = await run(
        engine, req("other", prompt, sampling=SamplingParams(temperature=0.9, top_k=50, seed=99))
    )
    assert different_seed != alone


async def test_final_delta_reports_usage_timing_and_seed(engine: AsyncEngine) -> None:
    tokens, deltas = await run(engine, req("u", [5, 6, 7], max_new=5, sampling=SamplingParams(temperature=1.0)))
    last = deltas[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 5) and len(tokens) == 5
    assert last.seed is not None
    assert 0 <= last.timing.queue_s <= last.timing.ttft_s <= last.timing.total_s
    assert all(d.finish_reason is None for d in deltas[:-1])


async def test_the_prefix_caches_stored_blocks_reach_the_front_end_as_events(engine: AsyncEngine) -> None:
    """Either core hands out the pool's events (kv_events.py) through the one interface, by the final delta."""
    bs = engine.stats().block_size
    prompt = [(7 * i) % 50 + 3 for i in range(2 * bs + 3)]  # two full blocks no other test of the module uses
    engine.take_kv_events()
    await run(engine, req("kv", prompt, max_new=2))
    stored = [e for e in engine.take_kv_events() if isinstance(e, KvStored)]
    chunks = [tuple(prompt[:bs]), tuple(prompt[bs : 2 * bs])]
    ours = [e for e in stored if e.tokens in chunks]
    assert [e.tokens for e in ours] == chunks and ours[1].parent == ours[0].block_hash, stored
    assert [e.number for e in ours] == sorted(e.number for e in ours)


async def test_logprobs_and_top_n(engine: AsyncEngine) -> None:
    _, deltas = await run(engine, req("lp", [5, 6, 7], max_new=3, logprobs=True, top_logprobs=5))
    lps = [lp for d in deltas for lp in (d.logprobs or [])]
    assert len(lps) == 3
    for lp in lps:
        assert len(lp.top) == 5 and lp.top[0][0] == lp.token_id  # greedy picks the most likely
        assert lp.logprob <= 0 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


async def test_stop_token_and_min_new_tokens(engine: AsyncEngine) -> None:
    greedy, _ = await run(engine, req("g", [9, 8, 7], max_new=12))
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    tokens, deltas = await run(
        engine, req("s", [9, 8, 7], stopping=StoppingParams(max_new_tokens=12, stop_token_ids=(stop_at,)))
    )
    assert tokens == greedy[: first + 1] and deltas[-1].finish_reason is FinishReason.STOP_TOKEN
    tokens, _ = await run(
        engine, req("m", [9, 8, 7], stopping=StoppingParams(12, min_new_tokens=first + 2, stop_token_ids=(stop_at,)))
    )
    assert stop_at not in tokens[: first + 2]


async def test_eos_is_honoured_unless_ignored(thread_engine: AsyncEngine) -> None:
    greedy, _ = await run(thread_engine, req("g", [9, 8, 7], max_new=4))
    inner(thread_engine).loaded.eos_token_ids = (greedy[0],)  # the model's first greedy token is its EOS now
    tokens, deltas = await run(thread_engine, req("e", [9, 8, 7], stopping=StoppingParams(max_new_tokens=12)))
    assert tokens == greedy[:1] and deltas[-1].finish_reason is FinishReason.EOS
    tokens, _ = await run(thread_engine, req("ignored", [9, 8, 7], max_new=4))
    assert tokens == greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(sampling=SamplingParams(temperature=-0.5)), "sampling.temperature"),
        (dict(sampling=SamplingParams(top_p=0.0)), "sampling.top_p"),
        (dict(sampling=SamplingParams(top_p=1.5)), "sampling.top_p"),
        (dict(sampling=SamplingParams(top_k=-1)), "sampling.top_k"),
        (dict(stopping=StoppingParams(max_new_tokens=0)), "stopping.max_new_tokens"),
        (dict(stopping=StoppingParams(max_new_tokens=600)), "stopping.max_new_tokens"),
        (dict(prompt=[]), "prompt_token_ids"),
        (dict(prompt=[1] * 600), "prompt_token_ids"),
        (dict(prompt=[10**6]), "prompt_token_ids"),
        (dict(top_logprobs=21), "response.top_logprobs"),
        (dict(prompt_top_logprobs=21), "response.prompt_top_logprobs"),
        (dict(prompt_logprobs=True, prompt_top_logprobs=-1), "response.prompt_top_logprobs"),
    ],
)
async def test_bad_input_is_rejected_naming_the_field(engine: AsyncEngine, kwargs: dict, field: str) -> None:
    kwargs = dict(kwargs)  # the parameter is shared by both cores' runs
    prompt = kwargs.pop("prompt", [1, 2, 3])
    request = GenerationRequest("bad", tuple(prompt), **kwargs)
    with pytest.raises(InvalidRequest) as info:
        await run(engine, request)
    assert info.value.field == field
    assert engine.num_running == 0 and engine.num_waiting == 0


async def test_request_that_never_fits_the_pool_is_rejected(small: AsyncEngine) -> None:
    with pytest.raises(InvalidRequest) as info:
        await run(small, req("big", [1] * 60, max_new=450))
    assert info.value.field == "stopping.max_new_tokens" and info.value.reason.endswith(
        "never fits the KV pool (496 tokens)"
    )
    tokens, _ = await run(small, req("whole-pool", [1] * 60, max_new=436))  # exactly the pool's 496 tokens: served
    assert len(tokens) == 436


async def test_a_cancelled_stream_ends_its_request_in_the_core(engine: AsyncEngine) -> None:
    stream = engine.generate(req("c", list(range(100)), max_new=400))
    assert (await stream.__anext__()).token_ids
    await stream.aclose()
    await wait_for(lambda: engine.num_running == 0 and engine.stats().kv_blocks_used == engine.stats().session_blocks)
    assert engine.num_waiting == 0 and len(engine._processor) == 0


async def test_cancelled_consumer_frees_its_blocks_within_an_iteration(thread_engine: AsyncEngine) -> None:
    engine = thread_engine
    pool = inner(engine).pool
    spy = StepSpy(inner(engine), step_delay_s=0.01)  # 400 tokens take >= 4 s: finishing alone cannot pass
    stream = engine.generate(req("c", list(range(100)), max_new=400))
    first = await stream.__anext__()
    assert first.token_ids
    cancelled_at = spy.num_steps
    await stream.aclose()
    assert (await asyncio.to_thread(spy.final, "c", 2.0)).finish_reason is FinishReason.CANCELLED
    assert spy.steps_with("c", since=cancelled_at) <= 2
    assert engine.num_running == 0 and pool.num_free == pool.num_blocks


async def test_task_cancellation_aborts_the_request(thread_engine: AsyncEngine) -> None:
    engine = thread_engine
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(req("t", [1, 2, 3], max_new=400)):
            started.set()

    spy = StepSpy(inner(engine), step_delay_s=0.01)
    task = asyncio.create_task(consume())
    await started.wait()
    cancelled_at = spy.num_steps
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await asyncio.to_thread(spy.final, "t", 2.0)).finish_reason is FinishReason.CANCELLED
    assert spy.steps_with("t", since=cancelled_at) <= 2
    assert engine.num_running == 0


async def test_deadline_finishes_the_request(engine: AsyncEngine) -> None:
    tokens, deltas = await run(engine, req("d", [1, 2, 3], max_new=400, deadline=time.monotonic() + 0.05))
    assert deltas[-1].finish_reason is FinishReason.DEADLINE and len(tokens) < 400


async def test_a_failed_forward_fails_its_batch_and_the_engine_keeps_serving(thread_engine: AsyncEngine) -> None:
    engine = thread_engine
    backend = inner(engine).backend
    real = backend.execute
    calls = 0

    def flaky(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    backend.execute = flaky
    _, deltas = await run(engine, req("f1", [1, 2, 3]))
    assert deltas[-1].finish_reason is FinishReason.ERROR and "boom" in deltas[-1].error
    tokens, deltas = await run(engine, req("f2", [1, 2, 3], max_new=4))
    assert deltas[-1].finish_reason is FinishReason.LENGTH and len(tokens) == 4
    assert not engine.dead


async def test_an_engine_that_cannot_recover_marks_itself_dead(thread_engine: AsyncEngine) -> None:
    engine = thread_engine

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("device lost")

    inner(engine).backend.execute = broken
    for i in range(3):
        _, deltas = await run(engine, req(f"x{i}", [1, 2, 3]))
        assert deltas[-1].finish_reason is FinishReason.ERROR
    assert engine.dead and "device lost" in engine.dead_reason
    with pytest.raises(EngineDead):
        await run(engine, req("after", [1, 2, 3]))


async def test_queue_full_past_max_waiting(small: AsyncEngine) -> None:
    tasks = [asyncio.create_task(run(small, req("running", [1, 2], max_new=400)))]
    try:
        await wait_for(lambda: small.num_running == 1)
        tasks += [asyncio.create_task(run(small, req(f"w{i}", [1, 2]))) for i in range(2)]  # one sequence at a time
        await wait_for(lambda: small.num_waiting == 2)
        with pytest.raises(QueueFull):
            await run(small, req("q", [1, 2]))
        assert small.stats().waiting == 2
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await wait_for(lambda: small.num_running + small.num_waiting == 0)


async def test_a_failed_forward_leaves_nothing_in_the_prefix_cache() -> None:
    """The failed step's blocks were never written: the same prompt afterwards must be computed cold."""
    loaded = from_config(tiny_config(max_positions=512), dtype=torch.float64)
    loaded.model.set_attn_implementation("sdpa")  # for the reference; the engine swaps in its own
    prompt = list(range(3, 40))  # two full blocks of 16
    cold = greedy_reference(loaded.model, prompt, 8)
    eng = AsyncEngine(loaded, CONFIG)
    await eng.start()
    try:
        backend = inner(eng).backend
        real = backend.execute

        def fail_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            backend.execute = real
            raise RuntimeError("boom")

        backend.execute = fail_once
        _, deltas = await run(eng, req("failed", prompt, max_new=4))
        assert deltas[-1].finish_reason is FinishReason.ERROR
        tokens, deltas = await run(eng, req("after", prompt, max_new=8))
        assert deltas[-1].usage.cached_prompt_tokens == 0
        assert tokens == cold
        assert inner(eng).pool.num_free == inner(eng).pool.num_blocks
    finally:
        await eng.shutdown()


async def test_a_sampling_failure_fails_its_request_alone(thread_engine: AsyncEngine, monkeypatch) -> None:  # noqa: ANN001
    """One row whose sampling raises ends ERROR; the rest of the batch gets exactly its tokens."""
    engine = thread_engine
    import llmserve.engine.sample.sampler as sampler_module

    real = sampler_module.sample

    def picky(logits, rows, streams):  # noqa: ANN001, ANN202
        if any(row.params.seed == 666 for row in rows):
            raise RuntimeError("bad row")
        return real(logits, rows, streams)

    prompts = {f"ok{i}": list(range(i + 2, i + 12)) for i in range(4)}
    alone = {rid: (await run(engine, req(rid + "-alone", p, max_new=12)))[0] for rid, p in prompts.items()}
    monkeypatch.setattr(sampler_module, "sample", picky)  # sample_each calls it for the batch, then per row
    bad = req("bad", [7, 8, 9], max_new=12, sampling=SamplingParams(temperature=1.0, seed=666))
    results = await asyncio.gather(
        run(engine, bad), *(run(engine, req(rid, p, max_new=12)) for rid, p in prompts.items())
    )
    bad_deltas = results[0][1]
    assert bad_deltas[-1].finish_reason is FinishReason.ERROR and "bad row" in bad_deltas[-1].error
    for (rid, _), (tokens, deltas) in zip(prompts.items(), results[1:], strict=True):
        assert tokens == alone[rid] and deltas[-1].finish_reason is FinishReason.LENGTH
    assert not engine.dead and inner(engine)._failures == 0


async def test_a_request_failing_after_its_forward_fails_alone(engine: AsyncEngine, monkeypatch) -> None:  # noqa: ANN001
    """Stop checks and detokenization (the front end's output processor) run per request: one that raises ends
    ERROR and is stopped in the core, the others go on."""
    real = OutputProcessor._delta

    def fragile(self, stream, output):  # noqa: ANN001, ANN202
        if stream.request_id == "fragile" and stream.num_generated >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")
        return real(self, stream, output)

    expected, _ = await run(engine, req("steady-alone", [4, 5, 6], max_new=10))
    monkeypatch.setattr(OutputProcessor, "_delta", fragile)
    (fragile_tokens, fragile_deltas), (tokens, deltas) = await asyncio.gather(
        run(engine, req("fragile", [1, 2, 3], max_new=10)), run(engine, req("steady", [4, 5, 6], max_new=10))
    )
    assert fragile_deltas[-1].finish_reason is FinishReason.ERROR
    assert fragile_deltas[-1].error.startswith("UnicodeDecodeError: ") and "planted" in fragile_deltas[-1].error
    assert len(fragile_tokens) == 2
    assert tokens == expected and deltas[-1].finish_reason is FinishReason.LENGTH
    async with asyncio.timeout(RUN_TIMEOUT_S):
        while engine.num_running:  # the core was told to stop the fragile one: it ends within a step
            await asyncio.sleep(0.01)
    assert not engine.dead and len(engine._processor) == 0


async def test_extreme_sampling_values_never_fail_a_batch(engine: AsyncEngine) -> None:
    """Valid but extreme values (top_p that underflows float32, ...) are served, batched with normal rows."""
    extremes = [
        SamplingParams(temperature=1.0, top_p=1e-46),
        SamplingParams(temperature=1e-46),
        SamplingParams(temperature=1e300, repetition_penalty=1e-300),
        SamplingParams(temperature=1.0, repetition_penalty=1e300, min_p=1.0, top_k=2**31 - 1),
    ]
    normal, _ = await run(engine, req("normal-alone", [5, 6, 7], max_new=8))
    for round_ in range(3):  # three failed steps in a row would make the engine dead
        results = await asyncio.gather(
            run(engine, req(f"n{round_}", [5, 6, 7], max_new=8)),
            *(run(engine, req(f"x{round_}-{i}", [1, 2, 3], max_new=8, sampling=s)) for i, s in enumerate(extremes)),
        )
        assert results[0][0] == normal
        for tokens, deltas in results:
            assert deltas[-1].finish_reason is FinishReason.LENGTH and len(tokens) == 8
    assert not engine.dead


async def test_abort_stops_the_request_within_two_steps(thread_engine: AsyncEngine) -> None:
    """After abort, the engine schedules the request in at most the step under way and the next one, and its
    final delta says CANCELLED; an engine that let it run would schedule it for hundreds more steps."""
    engine = thread_engine
    spy = StepSpy(inner(engine), step_delay_s=0.01)
    stream = engine.generate(req("victim", list(range(40)), max_new=400))
    async with asyncio.timeout(RUN_TIMEOUT_S):
        for _ in range(3):
            await stream.__anext__()
    cancelled_at = spy.num_steps
    await stream.aclose()  # aborts the request
    final = await asyncio.to_thread(spy.final, "victim")
    assert final is not None and final.finish_reason is FinishReason.CANCELLED
    await asyncio.sleep(0.1)  # ten more steps' time: an ignored abort would show here
    assert spy.steps_with("victim", since=cancelled_at) <= 2
    assert final.usage.completion_tokens < 400
    assert engine.num_running == 0


async def test_deltas_reach_the_event_loop_once_per_step_not_once_per_delta(thread_engine: AsyncEngine) -> None:
    """The step thread hands a step's deltas to the event loop in one call: eight streams of 16 tokens cost about
    as many thread-to-loop hand-offs as steps, not one per delta (~1 ms a step at 256 sequences)."""
    engine = thread_engine
    loop = asyncio.get_running_loop()
    handoffs = 0
    original = loop.call_soon_threadsafe

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal handoffs
        handoffs += 1
        return original(*args, **kwargs)

    steps_before = inner(engine).steps
    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(run(engine, req(f"h{i}", [i + 1, 2, 3], max_new=16)) for i in range(8)))
    finally:
        del loop.call_soon_threadsafe
    steps = inner(engine).steps - steps_before
    # 128 tokens, one output each, in about 20 batched steps; a loaded machine's slow loop may coalesce the
    # deltas a stream has not taken, so the count of tokens, not of deltas, is what is fixed.
    assert all(len(tokens) == 16 for tokens, _ in results) and steps < 8 * 16 // 2
    assert handoffs <= steps + 1, (handoffs, steps)


async def test_a_consumer_that_falls_behind_gets_what_it_has_not_taken_in_one_delta(engine: AsyncEngine) -> None:
    """The first token comes alone; a consumer that then stops reading while the engine finishes gets the rest
    in one delta, equal to what a consumer that keeps up gets in many: tokens, logprobs, the final's usage."""
    prompt = [5, 6, 7]
    keeping_up, steady = await run(engine, req("up", prompt, max_new=24, logprobs=True, top_logprobs=2))
    stream = engine.generate(req("behind", prompt, max_new=24, logprobs=True, top_logprobs=2))
    async with asyncio.timeout(RUN_TIMEOUT_S):
        first = await stream.__anext__()
        while engine.num_running or len(engine._processor):  # finished, and its last step's outputs processed
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        rest = [delta async for delta in stream]
    assert len(first.token_ids) == 1 and len(rest) == 1
    last = rest[0]
    assert first.token_ids + last.token_ids == keeping_up
    assert [lp.token_id for lp in first.logprobs + last.logprobs] == keeping_up
    assert [lp.top for lp in first.logprobs + last.logprobs] == [lp.top for d in steady for lp in d.logprobs]
    assert last.finish_reason is FinishReason.LENGTH and last.usage.completion_tokens == 24


@pytest.mark.parametrize("kind", CORES)
async def test_session_queries_are_answered_while_the_core_runs_and_fail_once_it_has_stopped(kind: str) -> None:
    """Asked of a busy core: answered between two steps. Asked before the stop: answered (the core drains its
    inbox before it ends). Asked after: EngineDead at once, never a future left pending."""
    eng = await start_engine(kind)
    stream = eng.generate(req("busy", list(range(3, 20)), max_new=200, session_id="other"))
    async with asyncio.timeout(RUN_TIMEOUT_S):
        await stream.__anext__()
        assert await eng.get_session("conv") is None  # answered between two steps
        await run(eng, req("s", list(range(3, 20)), max_new=3, session_id="conv"))
        assert (await eng.get_session("conv")).cached_tokens == 19
        await stream.aclose()
        asked = [asyncio.ensure_future(eng.get_session("conv")), asyncio.ensure_future(eng.delete_session("conv"))]
        await asyncio.sleep(0)  # both reach the core before the stop does
        racing = asyncio.ensure_future(eng.get_session("conv"))  # sent as the stop is: answered or refused
        await eng.shutdown()
        info, deleted = await asyncio.gather(*asked)
        assert info is not None and info.cached_tokens == 19 and deleted is True
        try:
            assert await racing is None  # deleted just before
        except EngineDead:
            pass
        with pytest.raises(EngineDead):
            await eng.get_session("conv")
        with pytest.raises(EngineDead):
            await eng.delete_session("conv")
        with pytest.raises(EngineDead):
            await run(eng, req("after", [1, 2, 3]))


@pytest.mark.parametrize("kind", CORES)
async def test_a_dead_core_ends_every_request_with_its_usage_and_answers_nothing(kind: str) -> None:
    """Killed under two running requests and a waiting one: each stream ends with ERROR and the usage of what it
    was sent (the waiting one: its prompt, nothing generated), with its timing; then the engine is dead, refuses
    requests, and fails session queries. Queries sent from another thread while it dies are each answered or fail,
    none left pending (the client checks for the end and registers a query in one step)."""
    config = EngineConfig(block_size=16, kv_cache_tokens=4096, max_num_seqs=2, max_num_batched_tokens=256)
    eng = await start_engine(kind, config=config)
    prompts = {f"r{i}": [4 + i] * (10 + i) for i in range(3)}  # no shared prefix: nothing cached
    received: dict[str, list[int]] = {rid: [] for rid in prompts}
    finals = {}

    async def consume(rid: str) -> None:
        async for delta in eng.generate(req(rid, prompts[rid], max_new=480)):
            received[rid] += delta.token_ids
            if delta.finished:
                finals[rid] = delta

    queries: list = []
    dying = threading.Event()

    def ask() -> None:
        while not dying.is_set():
            queries.append(eng.core.get_session("x"))
            time.sleep(0.0005)

    asker = threading.Thread(target=ask)
    tasks = [asyncio.create_task(consume(rid)) for rid in prompts]
    try:
        await wait_for(lambda: min(len(received["r0"]), len(received["r1"])) >= 2 and eng.num_waiting == 1)
        asked = asyncio.ensure_future(eng.get_session("any"))
        asker.start()
        await asyncio.sleep(0.02)
        kill_core(eng)
        async with asyncio.timeout(RUN_TIMEOUT_S):
            await asyncio.gather(*tasks)
            await asyncio.sleep(0.02)
            dying.set()
            await asyncio.to_thread(asker.join)
            assert len(queries) > 10
            for query in queries:
                error = await asyncio.to_thread(query.exception, 10)  # raises TimeoutError if left pending
                assert error is None or isinstance(error, EngineDead)
            for rid, prompt in prompts.items():
                final = finals[rid]
                assert final.finish_reason is FinishReason.ERROR and final.error, rid
                assert final.usage == Usage(len(prompt), 0, len(received[rid])), rid
                assert final.timing is not None and final.timing.total_s >= final.timing.ttft_s, rid
            assert received["r2"] == [] and len(received["r0"]) >= 2
            assert eng.dead and eng.num_running == 0 and eng.num_waiting == 0
            if kind == "process":
                assert "exit code -9" in (finals["r0"].error or "") and "exit code -9" in (eng.dead_reason or "")
            try:
                await asked  # answered before the core died, or failed with it
            except EngineDead:
                pass
            with pytest.raises(EngineDead):
                await eng.get_session("any")
            with pytest.raises(EngineDead):
                await run(eng, req("after", [1, 2], max_new=2))
    finally:
        dying.set()
        await eng.shutdown()


@pytest.mark.parametrize("kind", CORES)
async def test_every_way_a_request_ends_carries_its_usage_and_timing(kind: str) -> None:
    """One builder of the ended output, either core: a finished, a timed-out, a running request cut by the
    shutdown and one still waiting at it each end with the usage of what it was sent and its timing."""
    eng = await start_engine(kind, config=EngineConfig(block_size=16, kv_cache_tokens=4096, max_num_seqs=1))
    received: dict[str, list[int]] = {"run": [], "wait": []}
    finals = {}

    async def consume(rid: str, prompt: list[int]) -> None:
        async for delta in eng.generate(req(rid, prompt, max_new=400)):
            received[rid] += delta.token_ids
            if delta.finished:
                finals[rid] = delta

    try:
        _, done = await run(eng, req("done", [3, 4, 5], max_new=4))
        tokens, late = await run(eng, req("late", [6, 7], max_new=400, deadline=time.monotonic() + 0.05))
        tasks = [asyncio.create_task(consume("run", [8] * 9)), asyncio.create_task(consume("wait", [9] * 5))]
        await wait_for(lambda: len(received["run"]) >= 2 and eng.num_waiting == 1)
    finally:
        await eng.shutdown()
    async with asyncio.timeout(RUN_TIMEOUT_S):
        await asyncio.gather(*tasks)
    assert done[-1].finish_reason is FinishReason.LENGTH and done[-1].usage == Usage(3, 0, 4)
    assert late[-1].finish_reason is FinishReason.DEADLINE and late[-1].usage == Usage(2, 0, len(tokens))
    assert finals["run"].finish_reason is FinishReason.CANCELLED
    assert finals["run"].usage == Usage(9, 0, len(received["run"])) and len(received["run"]) >= 2
    assert finals["wait"].finish_reason is FinishReason.CANCELLED and finals["wait"].usage == Usage(5, 0, 0)
    for final in (done[-1], late[-1], finals["run"], finals["wait"]):
        assert final.timing is not None and 0 <= final.timing.queue_s <= final.timing.total_s, final


async def test_a_request_is_counted_once_waiting_or_running_by_admission_and_scrape_alike(small: AsyncEngine) -> None:
    """From generate() on, a request counts as waiting until the core reports it running, in the scrape's stats as
    in the admission count: also while it is on its way to the core (in the pipe, or its prompt still computing
    before the core reports anything), never as nothing."""
    await wait_for(lambda: small.num_running + small.num_waiting == 0)
    stream = small.generate(req("one", list(range(1, 300)), max_new=4))  # 19 prefill steps before its first token
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # generate() has added it
    stats = small.stats()
    assert (stats.waiting, stats.running) in ((1, 0), (0, 1)) and small.num_waiting + small.num_running >= 1
    await first
    async for _ in stream:
        pass
    await wait_for(lambda: small.stats().running == 0)
    assert (small.stats().waiting, small.num_waiting, small.num_running) == (0, 0, 0)


@pytest.mark.parametrize("kind", CORES)
async def test_each_grammar_is_compiled_once_in_the_engine_and_never_in_the_front_end(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The front end only checks a constraint; the engine compiles it, once per distinct spec, and each completion
    gets its own state: with the core on a thread, this process builds one matcher for two calls of n = 3; with the
    core in the engine process, none."""
    real = llguidance.LLMatcher
    built: list[str] = []

    class CountingMatcher:  # the library's class, counting what is built with it
        def __new__(cls, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
            built.append(threading.current_thread().name)
            return real(*args, **kwargs)

    for name in (
        "grammar_from_json_schema",
        "grammar_from_regex",
        "grammar_from_lark",
        "validate_grammar_with_warnings",
    ):
        setattr(CountingMatcher, name, getattr(real, name))
    monkeypatch.setattr(llguidance, "LLMatcher", CountingMatcher)
    from tests.service.harness import tiny_model

    eng = await start_engine(kind, load=tiny_model, config=EngineConfig(kv_cache_tokens=8192, max_n=4))
    try:
        spec = ConstraintSpec(ConstraintKind.CHOICE, choices=("yes", "no", "maybe"))
        for i in range(2):
            request = req(f"c{i}", [1, 2000, 28], max_new=8, n=3, constraint=spec,
                          sampling=SamplingParams(temperature=1.0, seed=i))  # fmt: skip
            _, deltas = await run(eng, request)
            assert {d.finish_reason for d in deltas if d.finished} == {FinishReason.CONSTRAINT}
        assert len(built) == (1 if kind == "thread" else 0), built
    finally:
        await eng.shutdown()


class ThreadRecordingTokenizer(PieceTokenizer):
    """A PieceTokenizer that notes which thread each decode ran on."""

    def __init__(self, pieces: dict[int, bytes]) -> None:
        super().__init__(pieces)
        self.threads: set[str] = set()

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.threads.add(threading.current_thread().name)
        return super().decode(token_ids, skip_special_tokens)


async def test_the_step_thread_never_detokenizes_and_a_stop_string_ends_the_request_in_the_core() -> None:
    """Text and stop strings are the front end's: every decode runs on the event loop's thread, none on the step
    thread; a stop string found there ends the stream and stops the request in the core, whose session then
    holds exactly the tokens the caller was sent (not the ones the core made while the stop was on its way)."""
    loaded = from_config(tiny_config(max_positions=512), dtype=torch.float64)
    core = EngineCore(loaded, CONFIG)
    greedy, pieces, text = with_text(core, [5, 6, 7], 12)
    tokenizer = ThreadRecordingTokenizer(pieces)
    loaded.tokenizer = tokenizer
    eng = AsyncEngine(loaded, CONFIG)
    spy = StepSpy(inner(eng), step_delay_s=0.01)  # steps slower than the stop's trip back to the core
    await eng.start()
    try:
        stop = text[4:6]
        cut = text.find(stop)
        stopping = StoppingParams(12, stop_sequences=(stop,), ignore_eos=True)
        tokens, deltas = await run(eng, req("s", [5, 6, 7], stopping=stopping, session_id="conv"))
        final = await asyncio.to_thread(spy.final, "s")
        held = await eng.get_session("conv")
    finally:
        await eng.shutdown()
    assert "".join(d.text for d in deltas) == text[:cut] and deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert tokens == greedy[: cut + 2] and deltas[-1].usage.completion_tokens == cut + 2
    assert deltas[-1].timing.ttft_s <= deltas[-1].timing.total_s
    assert final is not None and final.finish_reason is FinishReason.STOP_SEQUENCE
    assert final.usage.completion_tokens == cut + 2
    # The sent tokens' KV, the last one's too if the core computed it before the stop arrived; never more.
    assert held is not None and 3 + cut + 1 <= held.cached_tokens <= 3 + cut + 2
    assert tokenizer.threads and "llmserve-engine" not in tokenizer.threads
