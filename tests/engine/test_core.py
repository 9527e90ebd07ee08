"""The engine's front end and step loop: seeds, validation, cancellation, failures, deadlines."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.config import EngineConfig
from llmserve.engine.core import EngineCore
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.request import (
    EngineDead,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    QueueFull,
    SamplingParams,
    StoppingParams,
    Usage,
)
from llmserve.models import from_config
from tests.stepspy import StepSpy
from tests.tiny import greedy_reference, tiny_config

CONFIG = EngineConfig(block_size=16, kv_cache_tokens=4096, max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture
async def engine():
    loaded = from_config(tiny_config(max_positions=512), dtype=torch.float64)
    eng = AsyncEngine(loaded, CONFIG)
    await eng.start()
    yield eng
    await eng.shutdown()


# Every generation here takes well under a second: a stuck engine fails the test in seconds, not at pytest's timeout.
RUN_TIMEOUT_S = 30.0


async def run(engine: AsyncEngine, request: GenerationRequest) -> tuple[list[int], list]:
    tokens, deltas = [], []
    async with asyncio.timeout(RUN_TIMEOUT_S):
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
            deltas.append(delta)
    return tokens, deltas


def req(
    rid: str, prompt: list[int], *, max_new: int = 16, sampling: SamplingParams | None = None, **kw
) -> GenerationRequest:
    stopping = kw.pop("stopping", StoppingParams(max_new_tokens=max_new, ignore_eos=True))
    return GenerationRequest(rid, tuple(prompt), sampling=sampling or SamplingParams(), stopping=stopping, **kw)


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


async def test_logprobs_and_top_n(engine: AsyncEngine) -> None:
    _, deltas = await run(engine, req("lp", [5, 6, 7], max_new=3, logprobs=True, top_logprobs=5))
    lps = [lp for d in deltas for lp in (d.logprobs or [])]
    assert len(lps) == 3
    for lp in lps:
        assert len(lp.top) == 5 and lp.top[0][0] == lp.token_id  # greedy picks the most likely
        assert lp.logprob <= 0 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


async def test_stop_token_and_eos_and_min_new_tokens(engine: AsyncEngine) -> None:
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
    # EOS is honoured unless ignore_eos: make the model's first greedy token the EOS id.
    engine.core.loaded.eos_token_ids = (greedy[0],)
    tokens, deltas = await run(engine, req("e", [9, 8, 7], stopping=StoppingParams(max_new_tokens=12)))
    assert tokens == greedy[:1] and deltas[-1].finish_reason is FinishReason.EOS


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(sampling=SamplingParams(temperature=-0.5)), "temperature"),
        (dict(sampling=SamplingParams(top_p=0.0)), "top_p"),
        (dict(sampling=SamplingParams(top_p=1.5)), "top_p"),
        (dict(sampling=SamplingParams(top_k=-1)), "top_k"),
        (dict(stopping=StoppingParams(max_new_tokens=0)), "max_new_tokens"),
        (dict(stopping=StoppingParams(max_new_tokens=600)), "max_new_tokens"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1] * 600), "prompt"),
        (dict(prompt=[10**6]), "prompt_token_ids"),
        (dict(top_logprobs=21), "top_logprobs"),
    ],
)
async def test_bad_input_is_rejected_naming_the_field(engine: AsyncEngine, kwargs: dict, field: str) -> None:
    prompt = kwargs.pop("prompt", [1, 2, 3])
    request = GenerationRequest("bad", tuple(prompt), **kwargs)
    with pytest.raises(InvalidRequest) as info:
        await run(engine, request)
    assert info.value.field == field
    assert engine.num_running == 0 and engine.num_waiting == 0


async def test_request_that_never_fits_the_pool_is_rejected() -> None:
    loaded = from_config(tiny_config(), dtype=torch.float32)
    eng = AsyncEngine(loaded, EngineConfig(block_size=16, kv_cache_tokens=64))
    with pytest.raises(InvalidRequest) as info:
        async for _ in eng.generate(req("big", [1] * 60, max_new=10)):
            pass
    assert info.value.field == "max_new_tokens" and info.value.reason.endswith("never fits the KV pool (64 tokens)")
    eng.core.validate(req("whole-pool", [1] * 60, max_new=4))  # exactly the pool's 64 tokens: served


async def test_cancelled_consumer_frees_its_blocks_within_an_iteration(engine: AsyncEngine) -> None:
    pool = engine.core.pool
    spy = StepSpy(engine.core, step_delay_s=0.01)  # 400 tokens take >= 4 s: finishing alone cannot pass
    stream = engine.generate(req("c", list(range(100)), max_new=400))
    first = await stream.__anext__()
    assert first.token_ids
    cancelled_at = spy.num_steps
    await stream.aclose()
    assert (await asyncio.to_thread(spy.final, "c", 2.0)).finish_reason is FinishReason.CANCELLED
    assert spy.steps_with("c", since=cancelled_at) <= 2
    assert engine.num_running == 0 and pool.num_free == pool.num_blocks


async def test_task_cancellation_aborts_the_request(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(req("t", [1, 2, 3], max_new=400)):
            started.set()

    spy = StepSpy(engine.core, step_delay_s=0.01)
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


async def test_a_failed_forward_fails_its_batch_and_the_engine_keeps_serving(engine: AsyncEngine) -> None:
    backend = engine.core.backend
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


async def test_an_engine_that_cannot_recover_marks_itself_dead(engine: AsyncEngine) -> None:
    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("device lost")

    engine.core.backend.execute = broken
    for i in range(3):
        _, deltas = await run(engine, req(f"x{i}", [1, 2, 3]))
        assert deltas[-1].finish_reason is FinishReason.ERROR
    assert engine.dead and "device lost" in engine.dead_reason
    with pytest.raises(EngineDead):
        await run(engine, req("after", [1, 2, 3]))


async def test_queue_full_past_max_waiting() -> None:
    loaded = from_config(tiny_config(), dtype=torch.float32)
    eng = AsyncEngine(loaded, EngineConfig(block_size=16, kv_cache_tokens=4096, max_waiting=2))
    # Not started: nothing leaves the queue.
    waiting = [asyncio.create_task(run(eng, req(f"w{i}", [1, 2]))) for i in range(2)]
    await asyncio.sleep(0.05)
    assert eng.num_waiting == 2
    with pytest.raises(QueueFull):
        await run(eng, req("q", [1, 2]))
    for task in waiting:
        task.cancel()


def test_context_is_capped_at_a_sliding_window() -> None:
    from transformers import MistralConfig

    from llmserve.engine.core import EngineCore

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        sliding_window=256,
    )
    core = EngineCore(from_config(config), EngineConfig(kv_cache_tokens=1024))
    assert core.max_model_len == 256
    with pytest.raises(InvalidRequest):
        core.validate(req("long", [1] * 300, max_new=4))


async def test_a_failed_forward_leaves_nothing_in_the_prefix_cache() -> None:
    """The failed step's blocks were never written: the same prompt afterwards must be computed cold."""
    loaded = from_config(tiny_config(max_positions=512), dtype=torch.float64)
    loaded.model.set_attn_implementation("sdpa")  # for the reference; the engine swaps in its own
    prompt = list(range(3, 40))  # two full blocks of 16
    cold = greedy_reference(loaded.model, prompt, 8)
    eng = AsyncEngine(loaded, CONFIG)
    await eng.start()
    try:
        backend = eng.core.backend
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
        assert eng.core.pool.num_free == eng.core.pool.num_blocks
    finally:
        await eng.shutdown()


async def test_a_sampling_failure_fails_its_request_alone(engine: AsyncEngine, monkeypatch) -> None:  # noqa: ANN001
    """One row whose sampling raises ends ERROR; the rest of the batch gets exactly its tokens."""
    import llmserve.engine.sampler as sampler_module

    real = sampler_module.sample

    def picky(logits, rows):  # noqa: ANN001, ANN202
        if any(row.params.seed == 666 for row in rows):
            raise RuntimeError("bad row")
        return real(logits, rows)

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
    assert not engine.dead and engine.core._failures == 0


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
    assert not engine.dead and len(engine._outputs) == 0


async def test_extreme_sampling_values_never_fail_a_batch(engine: AsyncEngine) -> None:
    """Valid but extreme values (top_p that underflows float32, ...) are served, batched with normal rows."""
    extremes = [
        SamplingParams(temperature=1.0, top_p=1e-46),
        SamplingParams(temperature=1e-46),
        SamplingParams(temperature=1e300, repetition_penalty=1e-300),
        SamplingParams(temperature=1.0, repetition_penalty=1e300, min_p=1.0, top_k=2**31 - 1),
    ]
    normal, _ = await run(engine, req("normal-alone", [5, 6, 7], max_new=8))
    for round_ in range(3):  # three in a row used to kill the engine
        results = await asyncio.gather(
            run(engine, req(f"n{round_}", [5, 6, 7], max_new=8)),
            *(run(engine, req(f"x{round_}-{i}", [1, 2, 3], max_new=8, sampling=s)) for i, s in enumerate(extremes)),
        )
        assert results[0][0] == normal
        for tokens, deltas in results:
            assert deltas[-1].finish_reason is FinishReason.LENGTH and len(tokens) == 8
    assert not engine.dead


async def test_abort_stops_the_request_within_two_steps(engine: AsyncEngine) -> None:
    """After abort, the engine schedules the request in at most the step under way and the next one, and its
    final delta says CANCELLED; an engine that let it run would schedule it for hundreds more steps."""
    spy = StepSpy(engine.core, step_delay_s=0.01)
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


async def test_deltas_reach_the_event_loop_once_per_step_not_once_per_delta(engine: AsyncEngine) -> None:
    """The step thread hands a step's deltas to the event loop in one call: eight streams of 16 tokens cost about
    as many thread-to-loop hand-offs as steps, not one per delta (~1 ms a step at 256 sequences)."""
    loop = asyncio.get_running_loop()
    handoffs = 0
    original = loop.call_soon_threadsafe

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal handoffs
        handoffs += 1
        return original(*args, **kwargs)

    steps_before = engine.core.steps
    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(run(engine, req(f"h{i}", [i + 1, 2, 3], max_new=16)) for i in range(8)))
    finally:
        del loop.call_soon_threadsafe
    steps = engine.core.steps - steps_before
    deltas = sum(len(d) for _, d in results)
    assert all(len(tokens) == 16 for tokens, _ in results) and deltas >= 8 * 16
    assert handoffs <= steps + 1, (handoffs, steps, deltas)


async def test_a_consumer_that_falls_behind_gets_what_it_has_not_taken_in_one_delta(engine: AsyncEngine) -> None:
    """The first token comes alone; a consumer that then stops reading while the engine finishes gets the rest
    in one delta, equal to what a consumer that keeps up gets in many: tokens, logprobs, the final's usage."""
    prompt = [5, 6, 7]
    keeping_up, steady = await run(engine, req("up", prompt, max_new=24, logprobs=True, top_logprobs=2))
    stream = engine.generate(req("behind", prompt, max_new=24, logprobs=True, top_logprobs=2))
    async with asyncio.timeout(RUN_TIMEOUT_S):
        first = await stream.__anext__()
        while engine.num_running or len(engine._outputs):  # finished, and its last step's outputs processed
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        rest = [delta async for delta in stream]
    assert len(first.token_ids) == 1 and len(rest) == 1
    last = rest[0]
    assert first.token_ids + last.token_ids == keeping_up
    assert [lp.token_id for lp in first.logprobs + last.logprobs] == keeping_up
    assert [lp.top for lp in first.logprobs + last.logprobs] == [lp.top for d in steady for lp in d.logprobs]
    assert last.finish_reason is FinishReason.LENGTH and last.usage.completion_tokens == 24


# -- the step loop driven by hand (no thread): books, counters and the paths a live engine rarely takes ---------------


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


def test_stats_read_the_books() -> None:
    core = stepped_core()
    pool = core.pool
    empty = core.stats()
    assert (empty.running, empty.waiting, empty.kv_blocks_used, empty.kv_blocks_cached) == (0, 0, 0, 0)
    assert (empty.kv_blocks_total, empty.block_size) == (pool.num_blocks, 16)
    serve(core, req("s", list(range(3, 40)), max_new=4, session_id="conv"))  # 40 tokens computed: 3 blocks
    serve(core, req("p", list(range(3, 40)), max_new=2))  # no session: reuses the 2 full blocks cached by "s"
    stats = core.stats()
    assert (stats.sessions, stats.session_blocks, stats.kv_blocks_used) == (1, 3, 3)
    assert stats.kv_blocks_cached == pool.num_cached and pool.num_free == pool.num_blocks - 3
    assert (stats.session_hits, stats.session_misses, stats.prefix_cache_hits) == (0, 1, 1)
    assert stats.session_evictions == {"memory": 0, "limit": 0, "ttl": 0}
    assert stats.session_evictions is not core.sessions.evictions  # a snapshot, not the live dict
    core.submit(req("w", [1, 2, 3]))
    assert core.stats().waiting == 1 and core.num_waiting == 1  # still in the inbox
    core.drain_inbox()
    assert core.stats().waiting == 1 and core.scheduler.num_waiting == 1  # now in the scheduler's queue
    core.step()
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.preemptions) == (1, 0, 0) and core.num_running == 1


def ask(core: EngineCore, session_id: str, *, delete: bool = False) -> object:
    """A session query through the inbox, answered when this thread drains it (it is the step thread here)."""
    reply = core.query_session(session_id, delete=delete)
    assert not reply.done()  # only the thread that owns the books answers
    core.drain_inbox()
    return reply.result(timeout=0)


def test_sessions_are_read_and_deleted_through_the_inbox() -> None:
    core = stepped_core()
    assert ask(core, "conv") is None and ask(core, "conv", delete=True) is False
    timing = serve(core, req("s", list(range(3, 20)), max_new=3, session_id="conv"))[-1].timing
    assert core.steps == 3 and timing.ttft_s < timing.total_s < 60  # the first token came a step before the last
    info = ask(core, "conv")
    assert (info.session_id, info.cached_tokens) == ("conv", 19) and abs(info.last_used - time.time()) < 60
    assert ask(core, "conv", delete=True) is True and ask(core, "conv") is None


async def test_session_queries_reach_a_busy_step_thread_and_one_that_stopped(engine: AsyncEngine) -> None:
    stream = engine.generate(req("busy", list(range(3, 20)), max_new=200, session_id="other"))
    async with asyncio.timeout(RUN_TIMEOUT_S):
        await stream.__anext__()
        assert await engine.get_session("conv") is None  # answered between two steps
        await run(engine, req("s", list(range(3, 20)), max_new=3, session_id="conv"))
        assert (await engine.get_session("conv")).cached_tokens == 19
        await stream.aclose()
        await engine.shutdown()
        assert (await engine.get_session("conv")).cached_tokens == 19  # no step thread: answered at once
        assert await engine.delete_session("conv") is True and await engine.get_session("conv") is None


def test_only_consecutive_failed_steps_kill_the_engine() -> None:
    core = stepped_core()
    real = core.backend.execute
    failing = [True, True, False, True, True]  # two in a row, a success, two again: never three in a row

    def flaky(plan):  # noqa: ANN001, ANN202
        if failing.pop(0) if failing else False:
            raise RuntimeError("boom")
        return real(plan)

    core.backend.execute = flaky
    reasons = [serve(core, req(f"r{i}", [1, 2, 3], max_new=1))[-1].finish_reason for i in range(5)]
    error, length = FinishReason.ERROR, FinishReason.LENGTH
    assert reasons == [error, error, length, error, error]
    assert core.dead_reason is None and core._failures == 2 and core.steps == 1
    core.backend.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("gone"))  # noqa: ARG005
    final = serve(core, req("last", [1, 2, 3]))[-1]
    assert final.finish_reason is FinishReason.ERROR and "gone" in final.error
    assert core.dead_reason == "3 consecutive failed steps, last: RuntimeError: gone"


def test_a_request_that_reaches_a_dead_engine_gets_its_error() -> None:
    core = stepped_core()
    core.dead_reason = "device lost"
    deltas = serve(core, req("late", [1, 2, 3, 4]))
    assert len(deltas) == 1 and deltas[0].token_ids == [] and deltas[0].error == "device lost"
    assert deltas[0].request_id == "late"
    assert deltas[0].finish_reason is FinishReason.ERROR and deltas[0].usage == Usage(4, 0, 0)
    assert core.num_waiting == 0 and not core.scheduler.has_work


def test_an_engine_that_is_stopped_cancels_what_is_left() -> None:
    core = stepped_core()
    outputs: list = []
    core.submit(req("left", [1, 2, 3], max_new=50))
    stop = threading.Event()
    stop.set()
    core.run(stop, outputs.extend)  # drains the inbox, steps no more
    assert [o.finish_reason for o in outputs] == [FinishReason.CANCELLED] and core.num_running == 0


def test_sliding_window_is_read_where_the_config_enables_it() -> None:
    from transformers import MistralConfig, Qwen2Config

    from llmserve.engine.core import sliding_window

    assert sliding_window(MistralConfig(sliding_window=256)) == 256
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(Qwen2Config(sliding_window=128, use_sliding_window=False)) is None
    assert sliding_window(Qwen2Config(sliding_window=128, use_sliding_window=True)) == 128
    assert sliding_window(tiny_config()) is None
    assert sliding_window(SimpleNamespace(sliding_window=64, use_sliding_window=False)) is None
    assert sliding_window(SimpleNamespace(sliding_window=64)) == 64  # no get_text_config, no switch: on

    class Multimodal:
        sliding_window = None

        def get_text_config(self) -> SimpleNamespace:
            return SimpleNamespace(sliding_window=32, use_sliding_window=True)

    assert sliding_window(Multimodal()) == 32  # the text model's window


def test_seeds_the_engine_draws_can_be_sent_back() -> None:
    core = stepped_core()
    seeds = [
        serve(core, req(f"s{i}", [1, 2], max_new=1, sampling=SamplingParams(temperature=1.0)))[-1].seed
        for i in range(16)
    ]
    for seed in seeds:
        SamplingParams(temperature=1.0, seed=seed).validate()  # in [0, 2**63)
    assert len(set(seeds)) == 16


def test_eos_ends_a_request_unless_it_ignores_eos_and_prefix_caching_can_be_off() -> None:
    core = stepped_core(enable_prefix_caching=False)
    greedy = [t for d in serve(core, req("g", list(range(3, 40)), max_new=4)) for t in d.token_ids]
    core.loaded.eos_token_ids = (greedy[0],)
    ignoring = serve(core, req("ignore", list(range(3, 40)), max_new=4))  # req() sets ignore_eos
    assert [t for d in ignoring for t in d.token_ids] == greedy and ignoring[-1].finish_reason is FinishReason.LENGTH
    assert ignoring[-1].usage.cached_prompt_tokens == 0  # no prefix cache: two full blocks computed again
    ending = serve(core, req("eos", list(range(3, 40)), stopping=StoppingParams(max_new_tokens=4)))
    assert [t for d in ending for t in d.token_ids] == greedy[:1] and ending[-1].finish_reason is FinishReason.EOS


def test_a_dying_engine_fails_the_requests_still_waiting() -> None:
    core = stepped_core(max_num_seqs=1)
    core.backend.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("gone"))  # noqa: ARG005
    for i in range(4):
        core.submit(req(f"r{i}", [1, 2, 3]))
    core.drain_inbox()
    for _ in range(3):  # one running request per step: the third failure kills the engine
        core.step()
    finals = {out.request_id: out for out in core.take_outputs()}
    assert core.dead_reason == "3 consecutive failed steps, last: RuntimeError: gone"
    waiting = finals["r3"]
    assert waiting.finish_reason is FinishReason.ERROR and waiting.error == core.dead_reason
    assert all(finals[f"r{i}"].error == "RuntimeError: gone" for i in range(3))
    assert core.num_running == 0 and not core.scheduler.has_work


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


def test_text_and_stop_sequences_in_the_deltas() -> None:
    core = stepped_core()
    untitled = serve(core, req("no-tokenizer", [5, 6, 7], max_new=3))  # a model without a tokenizer: ids only
    assert [d.text for d in untitled] == ["", "", ""] and all(d.logprobs is None for d in untitled)
    greedy, _, text = with_text(core, [5, 6, 7], 8)
    deltas = serve(core, req("plain", [5, 6, 7], max_new=8))
    assert [d.text for d in deltas] == list(text) and deltas[-1].finish_reason is FinishReason.LENGTH
    assert {d.request_id for d in deltas} == {"plain"}
    stop = text[3:5]
    cut = text.find(stop)
    deltas = serve(core, req("stop", [5, 6, 7], stopping=StoppingParams(8, stop_sequences=(stop,), ignore_eos=True)))
    assert "".join(d.text for d in deltas) == text[:cut] and deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert [t for d in deltas for t in d.token_ids] == greedy[: cut + 2]
    stopping = StoppingParams(8, stop_sequences=(stop,), include_stop_sequence=True, ignore_eos=True)
    deltas = serve(core, req("with-stop", [5, 6, 7], stopping=stopping))
    assert "".join(d.text for d in deltas) == text[: cut + 2]
    # A stop that never completes holds back the last letter; the final delta flushes it.
    never = text[-1] + "#"
    deltas = serve(core, req("held", [5, 6, 7], stopping=StoppingParams(8, stop_sequences=(never,), ignore_eos=True)))
    assert "".join(d.text for d in deltas) == text and deltas[-1].finish_reason is FinishReason.LENGTH
    assert deltas[-1].text.endswith(text[-1])


def test_a_stop_completed_by_the_flushed_tail_ends_as_a_stop_sequence() -> None:
    core = stepped_core()
    # A prompt whose first two greedy tokens differ (the tiny model repeats itself after some).
    prompt = next(p for p in ([i, i + 1, i + 2] for i in range(1, 200, 7)) if len(set(with_text(core, p, 2)[0])) == 2)
    greedy, pieces, _ = with_text(core, prompt, 2)
    pieces[greedy[0]], pieces[greedy[1]] = b"xa", b"b\xc3"  # "b" comes with half a character: held back
    stopping = StoppingParams(2, stop_sequences=("ab",), ignore_eos=True)
    deltas = serve(core, req("tail", prompt, stopping=stopping))
    assert "".join(d.text for d in deltas) == "x" and deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE


def test_the_loaded_tokenizer_is_used_and_a_far_deadline_does_not_end_a_request() -> None:
    loaded = from_config(tiny_config(max_positions=512), dtype=torch.float32)
    loaded.tokenizer = PieceTokenizer({})  # every id reads "?"
    core = EngineCore(loaded, EngineConfig(block_size=16, kv_cache_tokens=1024))
    deltas = serve(core, req("far", [1, 2, 3], max_new=3, deadline=time.monotonic() + 3600))
    assert "".join(d.text for d in deltas) == "???" and deltas[-1].finish_reason is FinishReason.LENGTH


def test_a_failed_forward_leaves_no_session_behind() -> None:
    core = stepped_core()
    real, calls = core.backend.execute, []

    def second_fails(plan):  # noqa: ANN001, ANN202
        calls.append(plan)
        if len(calls) == 2:  # after the prompt was computed
            raise RuntimeError("boom")
        return real(plan)

    core.backend.execute = second_fails
    final = serve(core, req("failed", list(range(3, 40)), session_id="conv"))[-1]
    assert final.finish_reason is FinishReason.ERROR and final.usage.completion_tokens == 1
    assert ask(core, "conv") is None
    assert core.pool.num_free == core.pool.num_blocks


def test_a_fault_in_the_books_fails_the_requests_instead_of_hanging_them() -> None:
    """An exception outside the forward (here the scheduler's) used to end the step thread silently: every caller
    waited forever and the engine still looked alive. Now the engine dies and says why."""
    core = stepped_core()
    finals: dict[str, object] = {}
    core.submit(req("caught", [1, 2, 3], max_new=50))

    def emit(outputs: list) -> None:
        finals.update((out.request_id, out) for out in outputs if out.finished)

    def broken() -> None:
        raise RuntimeError("books out of balance")

    core.scheduler.schedule = broken
    stop = threading.Event()
    thread = threading.Thread(target=core.run, args=(stop, emit), daemon=True)
    thread.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while "caught" not in finals and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    core.wake()
    thread.join(RUN_TIMEOUT_S)
    final = finals["caught"]
    assert final.finish_reason is FinishReason.ERROR and "books out of balance" in final.error
    assert core.dead_reason == "engine step failed: RuntimeError: books out of balance" and not thread.is_alive()


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
    spy = StepSpy(eng.core, step_delay_s=0.01)  # steps slower than the stop's trip back to the core
    await eng.start()
    try:
        stop = text[4:6]
        cut = text.find(stop)
        stopping = StoppingParams(12, stop_sequences=(stop,), ignore_eos=True)
        tokens, deltas = await run(eng, req("s", [5, 6, 7], stopping=stopping, session_id="conv"))
        final = await asyncio.to_thread(spy.final, "s")
    finally:
        await eng.shutdown()
    assert "".join(d.text for d in deltas) == text[:cut] and deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert tokens == greedy[: cut + 2] and deltas[-1].usage.completion_tokens == cut + 2
    assert deltas[-1].timing.ttft_s <= deltas[-1].timing.total_s
    assert final is not None and final.finish_reason is FinishReason.STOP_SEQUENCE
    assert final.usage.completion_tokens == cut + 2
    # The sent tokens' KV, the last one's too if the core computed it before the stop arrived; never more.
    assert 3 + cut + 1 <= (await eng.get_session("conv")).cached_tokens <= 3 + cut + 2
    assert tokenizer.threads and "llmserve-engine" not in tokenizer.threads
