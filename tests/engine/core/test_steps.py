"""How a step runs (core/steps.py). The overlapped step (--async-scheduling, OverlapRunner): the same tokens as plain
steps, and nothing from a step planned before a sequence left; a slow backend shows the next step planned while the
previous one runs. The token sink (TokenSink): each token joins its request through the stop checks, up to the first
that ends it. (The plain step, PlainRunner, runs every core's tests: core/test_engine_core.py and the rest.)"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.core.steps import OverlapRunner, TokenSink
from llmserve.engine.sample.constraints import ConstraintCompiler, Vocabulary
from llmserve.engine.sample.sampler import Sampled
from llmserve.engine.sched.plan import PENDING, StepPlan
from llmserve.engine.sched.sequence import Sequence
from llmserve.engine.types.outputs import FinishReason, RequestStart, TokenLogprob
from llmserve.engine.types.request import (
    ConstraintKind,
    ConstraintSpec,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)
from tests.engine.engine_helpers import CONFIG, req, run, serve, start_engine, stepped_core, with_text
from tests.engine.sched.pool_checks import pinned

SAMPLED = SamplingParams(temperature=1.0, seed=99)


def _drive(core: EngineCore, requests: list, *, abort_at: dict[str, int] | None = None, max_steps: int = 400) -> dict:
    """Submit every request, step by hand until all have ended; per request id its tokens and final output.
    `abort_at`: abort a request once it has that many tokens (as a client's cancel between two steps)."""
    handles = {core.submit(r): r.request_id for r in requests}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finals: dict[str, object] = {}
    aborted: set[str] = set()
    for _ in range(max_steps):
        core.drain_inbox()
        for out in core.take_outputs():
            rid = handles[out.handle]
            assert rid not in finals, f"{rid} got an output after its final one"
            tokens[rid].extend(out.token_ids)
            if out.finished:
                finals[rid] = out
        for rid, at in (abort_at or {}).items():
            handle = next(h for h, r in handles.items() if r == rid)
            if rid not in aborted and rid not in finals and len(tokens[rid]) >= at:
                core.abort(handle)
                aborted.add(rid)
        if len(finals) == len(requests):
            return {rid: (tokens[rid], finals[rid]) for rid in tokens}
        core.step()
    raise AssertionError("not every request ended")


def _mixed(stop_ids: tuple[int, ...] = ()) -> list:
    """Requests of different lengths arriving together: prompt chunks beside decodes, some ending early."""
    out = []
    for i in range(6):
        prompt = [(7 * i + j) % 400 + 1 for j in range(5 + 9 * i)]
        stopping = StoppingParams(max_new_tokens=4 + 5 * i, stop_token_ids=stop_ids, ignore_eos=True)
        out.append(req(f"r{i}", prompt, stopping=stopping))
    return out


def _both(requests_of, **overrides) -> tuple[dict, dict, EngineCore]:  # noqa: ANN001, ANN003
    plain = _drive(stepped_core(**overrides), requests_of())
    core = stepped_core(async_scheduling=True, **overrides)
    return plain, _drive(core, requests_of()), core


def _assert_clean(core: EngineCore) -> None:
    """Once the commands left are drained and the step in flight has landed, nothing is held."""
    core.drain_inbox()
    assert not core.scheduler.has_work
    if core.runner.in_flight:
        core.step()  # nothing to plan: lands the step in flight, whose tokens all go nowhere
    assert not core.runner.in_flight
    assert not core.scheduler.live and len(core.backend.paged.states.streams) == 0
    assert core.pool.num_free == core.pool.num_blocks
    assert pinned(core.scheduler) == []


def test_overlapped_greedy_equals_plain_steps_under_concurrency() -> None:
    plain, overlapped, core = _both(_mixed)
    assert isinstance(core.runner, OverlapRunner)
    for rid, (tokens, final) in plain.items():
        assert overlapped[rid][0] == tokens, rid
        assert overlapped[rid][1].finish_reason is final.finish_reason is FinishReason.LENGTH
        assert overlapped[rid][1].usage == final.usage
    _assert_clean(core)


def test_stop_tokens_end_overlapped_requests_where_plain_ones_end() -> None:
    # A stop token that the plain run meets mid-stream in some requests: the token sampled after it, in the step
    # planned before the stop was seen, is dropped.
    plain = _drive(stepped_core(), _mixed())
    stop = plain["r5"][0][6]
    plain, overlapped, core = _both(lambda: _mixed((stop,)))
    assert any(final.finish_reason is FinishReason.STOP_TOKEN for _, final in plain.values())
    for rid, (tokens, final) in plain.items():
        assert overlapped[rid][0] == tokens and overlapped[rid][1].finish_reason is final.finish_reason, rid
    _assert_clean(core)


def test_preemption_under_overlap_gives_the_same_tokens_greedy_and_seeded() -> None:
    def requests() -> list:
        out = [req(f"g{i}", [(3 * i + j) % 300 + 1 for j in range(20)], max_new=40) for i in range(3)]
        prompts = [[(5 * i + j) % 300 + 2 for j in range(20)] for i in range(2)]
        out += [req(f"s{i}", p, max_new=40, sampling=SAMPLED) for i, p in enumerate(prompts)]
        return out

    plain = _drive(stepped_core(), requests())  # room for all: no preemption
    core = stepped_core(async_scheduling=True, kv_cache_tokens=192, max_num_seqs=5)
    overlapped = _drive(core, requests())
    assert core.scheduler.num_preemptions > 0
    for rid, (tokens, _) in plain.items():
        assert overlapped[rid][0] == tokens, rid
    _assert_clean(core)


def test_cancellation_mid_stream_acts_at_once_and_drops_the_token_in_flight() -> None:
    core = stepped_core(async_scheduling=True)
    plain = _drive(stepped_core(), _mixed())
    out = _drive(core, _mixed(), abort_at={"r4": 5, "r5": 1})
    for rid in ("r4", "r5"):
        tokens, final = out[rid]
        assert final.finish_reason is FinishReason.CANCELLED
        # The abort came after the outputs that reached the count; at most the step landed with it came on top.
        assert tokens == plain[rid][0][: len(tokens)] and len(tokens) <= {"r4": 5, "r5": 1}[rid] + 1
    for rid in ("r0", "r1", "r2", "r3"):
        assert out[rid][0] == plain[rid][0]
    _assert_clean(core)


def test_a_stop_string_drops_the_tokens_sampled_after_it() -> None:
    plain_core, core = stepped_core(), stepped_core(async_scheduling=True)
    greedy, _, text = with_text(plain_core, [5, 6, 7], 10)
    with_text(core, [5, 6, 7], 10)
    stop = text[3:5]
    cut = text.find(stop)
    stopping = StoppingParams(10, stop_sequences=(stop,), ignore_eos=True)
    deltas = serve(core, req("stop", [5, 6, 7], stopping=stopping))
    assert "".join(d.text for d in deltas) == text[:cut] and deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert [t for d in deltas for t in d.token_ids] == greedy[: cut + 2]
    assert deltas[-1].usage.completion_tokens == cut + 2
    _assert_clean(core)


def test_constrained_and_penalised_requests_make_the_step_wait_for_their_token() -> None:
    core = stepped_core(async_scheduling=True)
    penalised = SamplingParams(repetition_penalty=1.3)
    plans: list[StepPlan] = []
    real = core.scheduler.schedule

    def schedule(*args):  # noqa: ANN002, ANN202
        plan = real(*args)
        plans.append(plan)
        return plan

    core.scheduler.schedule = schedule
    want = _drive(stepped_core(), [req("p", [1, 2, 3], max_new=8, sampling=penalised)])
    got = _drive(core, [req("p", [1, 2, 3], max_new=8, sampling=penalised)])
    assert got["p"][0] == want["p"][0]
    assert all(PENDING not in entry.token_ids for plan in plans for entry in plan.seqs)
    _assert_clean(core)


def test_speculative_decoding_and_kv_tiers_turn_overlap_off() -> None:
    assert not isinstance(stepped_core(async_scheduling=True, speculative="ngram").runner, OverlapRunner)
    assert isinstance(stepped_core(async_scheduling=True).runner, OverlapRunner)
    assert not isinstance(stepped_core().runner, OverlapRunner)


class Slow:
    """The CPU backend with `delay` seconds more per step, recording when each step ran."""

    def __init__(self, backend, delay: float) -> None:  # noqa: ANN001
        self.inner = backend
        self.delay = delay
        self.runs: list[tuple[float, float, StepPlan]] = []

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def execute(self, plan: StepPlan):  # noqa: ANN201
        start = time.monotonic()
        time.sleep(self.delay)
        results = self.inner.execute(plan)
        self.runs.append((start, time.monotonic(), plan))
        return results


def _slow_core(delay: float) -> tuple[EngineCore, Slow, list[float]]:
    core = stepped_core(async_scheduling=True)
    slow = Slow(core.backend, delay)
    core.backend = slow  # type: ignore[assignment]
    planned: list[float] = []
    real = core.scheduler.schedule

    def schedule(*args):  # noqa: ANN002, ANN202
        planned.append(time.monotonic())
        return real(*args)

    core.scheduler.schedule = schedule
    return core, slow, planned


def test_the_next_step_is_planned_while_the_previous_one_runs() -> None:
    core, slow, planned = _slow_core(0.05)
    out = _drive(core, [req("a", [1, 2, 3], max_new=8), req("b", [4, 5, 6, 7], max_new=8)])
    assert out["a"][0] == _drive(stepped_core(), [req("a", [1, 2, 3], max_new=8)])["a"][0]
    # Every step after the first was planned inside its predecessor's run on the worker.
    inside = [t for t in planned if any(start < t < end for start, end, _ in slow.runs)]
    assert len(slow.runs) == 8 and len(inside) >= 6
    # The placeholders a plan held were filled with the tokens its predecessor sampled.
    assert all(PENDING not in entry.token_ids for _, _, plan in slow.runs for entry in plan.seqs)
    _assert_clean(core)


def test_a_finished_sequence_gets_nothing_from_the_step_planned_before_it_finished() -> None:
    core, slow, _ = _slow_core(0.02)
    plain = _drive(stepped_core(), [req("x", [9, 8, 7], max_new=12)])["x"][0]
    first = next(i for i in range(2, len(plain)) if plain[i] not in plain[:i])  # a token first met mid-stream
    stop = plain[first]
    stopping = StoppingParams(max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True)
    tokens, final = _drive(core, [req("x", [9, 8, 7], stopping=stopping)])["x"]
    assert tokens == plain[: first + 1] and final.finish_reason is FinishReason.STOP_TOKEN
    _assert_clean(core)
    # The step after the one that sampled the stop token had been planned (and ran) with x in it; its token for x
    # went nowhere.
    with_x = [plan for _, _, plan in slow.runs if any(e.seq.request_id == "x" for e in plan.seqs)]
    assert len(with_x) == first + 2


def test_a_deadline_ends_an_overlapped_request_within_a_step() -> None:
    core, slow, _ = _slow_core(0.02)
    deadline = time.monotonic() + 0.15
    tokens, final = _drive(core, [req("late", [1, 2, 3], max_new=200, deadline=deadline)])["late"]
    assert final.finish_reason is FinishReason.DEADLINE
    assert len(tokens) < 200 and time.monotonic() - deadline < 0.15  # ended within a step or two of it
    _assert_clean(core)


async def test_an_overlapped_engine_serves_concurrent_streams_as_a_plain_one() -> None:
    config = EngineConfig(**{**_fields(CONFIG), "async_scheduling": True})
    prompts = [[(11 * i + j) % 300 + 1 for j in range(4 + 3 * i)] for i in range(8)]
    engines = [await start_engine("thread", config=c) for c in (CONFIG, config)]
    try:
        results = []
        for engine in engines:
            calls = [run(engine, req(f"c{i}", p, max_new=6 + i)) for i, p in enumerate(prompts)]
            results.append([tokens for tokens, _ in await asyncio.gather(*calls)])
        assert results[0] == results[1]
    finally:
        for engine in engines:
            await engine.shutdown()
    assert threading.active_count() < 50


def _fields(config: EngineConfig) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_a_failed_forward_fails_its_requests_and_the_step_launched_after_it() -> None:
    core = stepped_core(async_scheduling=True)
    real, calls = core.backend.execute, []

    def third_fails(plan):  # noqa: ANN001, ANN202
        calls.append(plan)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(plan)

    core.backend.execute = third_fails
    requests = [
        req("s", list(range(3, 40)), max_new=20, sampling=SAMPLED, session_id="conv"),
        req("g", [1, 2, 3], max_new=20),
    ]
    out = _drive(core, requests)
    for rid in ("s", "g"):
        assert out[rid][1].finish_reason is FinishReason.ERROR and out[rid][1].error == "RuntimeError: boom"
    assert len(calls) == 4  # the fourth step, planned with placeholders from the third, ran and was dropped
    assert core.sessions.info("conv", None) is None  # nothing of the failed steps kept for the session
    _assert_clean(core)
    core.backend.execute = real
    assert _drive(core, [req("after", [1, 2, 3], max_new=5)])["after"][1].finish_reason is FinishReason.LENGTH
    assert core.dead_reason is None
    _assert_clean(core)


def test_a_random_stream_outlives_its_request_only_until_the_step_in_flight_lands() -> None:
    core = stepped_core(async_scheduling=True)
    streams = core.backend.paged.states.streams
    aborted = core.submit(req("aborted", [1, 2, 3], max_new=50, sampling=SAMPLED))
    kept = core.submit(req("kept", [4, 5, 6], max_new=50, sampling=SAMPLED))
    core.drain_inbox()
    for _ in range(3):
        core.step()
    core.abort(aborted)
    core.drain_inbox()
    assert core.take_outputs()[-1].finish_reason is FinishReason.CANCELLED  # its end is out at once
    launched = core.runner.launched  # type: ignore[attr-defined]  # an OverlapRunner's
    assert launched is not None and aborted in launched.releases  # the step in flight may still draw
    core.step()
    assert aborted not in streams and kept in streams
    stop = threading.Event()
    stop.set()
    core.run(stop, lambda outputs: None)  # stops at once: cancels what is left, the step in flight dropped
    assert len(streams) == 0 and not core.runner.in_flight
    assert core.pool.num_free == core.pool.num_blocks


# -- the token sink (steps.TokenSink): a token joins its request here, through the stop checks -------------------


def _seq(prompt: list[int], **stopping: object) -> Sequence:
    stopping.setdefault("max_new_tokens", 8)
    request = GenerationRequest("sink", tuple(prompt), stopping=StoppingParams(**stopping))  # type: ignore[arg-type]
    seq = Sequence.of(request, 7, 1.0, [2], None)
    seq.first_scheduled = 1.5
    return seq


def _picked(*tokens: int) -> list[Sampled]:
    return [Sampled(t, TokenLogprob(t, -0.5)) for t in tokens]


def test_the_sink_appends_tokens_one_by_one_up_to_the_first_that_ends_the_request() -> None:
    sink = TokenSink(max_model_len=64)
    seq = _seq([1, 1, 1], stop_token_ids=(9,))
    first = sink.append(seq, _picked(4, 5), now=3.0)
    assert first.reason is None and first.output.token_ids == [4, 5] and seq.token_ids == [1, 1, 1, 4, 5]
    assert first.output.logprobs == [TokenLogprob(4, -0.5), TokenLogprob(5, -0.5)]
    assert first.output.start == RequestStart(3, 0, None, 1.0, 0.5, 2.0)  # the accounts at its first token
    ended = sink.append(seq, _picked(6, 9, 8), now=4.0)
    assert ended.reason is FinishReason.STOP_TOKEN and ended.output.token_ids == [6, 9]  # 8 is never appended
    assert ended.output.start is None and seq.token_ids[-1] == 9


@pytest.mark.parametrize(
    ("stopping", "tokens", "reason", "kept"),
    [
        ({}, [4, 2, 5], FinishReason.EOS, [4, 2]),  # the model's EOS (2)
        ({"ignore_eos": True}, [4, 2, 5], None, [4, 2, 5]),
        ({"stop_token_ids": (2,)}, [4, 2], FinishReason.STOP_TOKEN, [4, 2]),  # a stop token before EOS
        ({"max_new_tokens": 2}, [4, 5, 6], FinishReason.LENGTH, [4, 5]),
    ],
)
def test_each_stop_check_ends_the_request_at_its_token(
    stopping: dict[str, object], tokens: list[int], reason: FinishReason | None, kept: list[int]
) -> None:
    appended = TokenSink(max_model_len=64).append(_seq([1], **stopping), _picked(*tokens), now=2.0)
    assert appended.reason is reason and appended.output.token_ids == kept


def test_the_context_ends_a_request_at_max_model_len() -> None:
    seq = _seq([1, 1, 1], max_new_tokens=100)
    appended = TokenSink(max_model_len=5).append(seq, _picked(4, 5, 6), now=2.0)
    assert appended.reason is FinishReason.LENGTH and len(seq.token_ids) == 5


def test_a_constraint_ends_its_request_when_complete_and_fails_it_on_a_token_it_refuses(smollm_tokenizer) -> None:
    vocab = len(smollm_tokenizer)
    compiler = ConstraintCompiler(Vocabulary(smollm_tokenizer, vocab, [smollm_tokenizer.eos_token_id]))
    try:
        grammar = compiler.submit(ConstraintSpec(ConstraintKind.CHOICE, choices=("yes", "no"))).result()
    finally:
        compiler.close()
    yes = smollm_tokenizer.encode("yes", add_special_tokens=False)
    sink = TokenSink(max_model_len=64)
    seq = _seq([1], max_new_tokens=8)
    seq.constraint = grammar.start()
    done = sink.append(seq, _picked(*yes, 5), now=2.0)
    assert done.reason is FinishReason.CONSTRAINT and done.output.token_ids == yes
    refused = _seq([1])
    refused.constraint = grammar.start()
    failed = sink.append(refused, _picked(*smollm_tokenizer.encode("maybe", add_special_tokens=False)), now=2.0)
    assert failed.reason is FinishReason.ERROR and failed.error is not None
    assert failed.error.startswith("the constraint rejected token")
