"""n completions of one prompt (frontend/fanout.py, and the scheduler's `after`): the prompt's KV is computed once and
its full blocks are shared, seeds follow the documented derivation, and the merged stream keeps each completion's
order."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.engine.frontend.async_engine import DeltaStream
from llmserve.engine.frontend.fanout import SEED_MODULUS, derive_seed, split
from llmserve.engine.frontend.output_processor import OutputProcessor
from llmserve.engine.sample.sampler import RowFailed
from llmserve.engine.sched.sequence import SeqStatus
from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.outputs import Delta, FinishReason, Usage
from llmserve.engine.types.request import GenerationRequest, SamplingParams, validate
from tests.engine.engine_helpers import req, run, stepped_core
from tests.engine.sched.pool_checks import check_pool

SAMPLED = SamplingParams(temperature=1.0, top_k=50)
BS = 16


def _prompt(length: int) -> list[int]:
    return [(7 * i + 3) % 500 + 3 for i in range(length)]


class _Spy:
    """Counts the tokens each step computes (prefill and decode) per handle."""

    def __init__(self, core) -> None:  # noqa: ANN001
        self.computed: dict[int, int] = {}
        real = core.scheduler.schedule

        def schedule():  # noqa: ANN202
            plan = real()
            for entry in plan.seqs:
                self.computed[entry.seq.seq_no] = self.computed.get(entry.seq.seq_no, 0) + len(entry.token_ids)
            return plan

        core.scheduler.schedule = schedule


def _serve_n(core, request: GenerationRequest, *, on_step=None, max_steps: int = 500) -> dict[int, list[Delta]]:  # noqa: ANN001
    """Submit the n completions as AsyncEngine.generate does and step by hand until all finished."""
    processor = OutputProcessor(core.loaded.tokenizer)
    deltas: dict[int, list[Delta]] = {}
    handles: list[int] = []
    for index, single in enumerate(split(request)):
        handle = core.submit(single, after=handles[0] if handles else None)
        processor.add(handle, single, deltas.setdefault(index, []).append, index)
        handles.append(handle)
    for _ in range(max_steps):
        core.drain_inbox()
        for handle, keep in processor.process(core.take_outputs()):
            core.abort(handle, keep)
        if all(d and d[-1].finished for d in deltas.values()):
            return deltas
        core.step()
        if on_step is not None:
            on_step()
    raise AssertionError("not all completions finished")


def test_seeds_derive_from_the_request_seed() -> None:
    assert derive_seed(5, 3) == 8
    assert derive_seed(SEED_MODULUS - 1, 2) == 1
    seeded = split(req("a", [1, 2, 3], sampling=SamplingParams(temperature=1.0, seed=41), n=3))
    assert [r.sampling.seed for r in seeded] == [41, 42, 43]
    assert all(r.n == 1 for r in seeded)
    picked = split(req("a", [1, 2, 3], sampling=SamplingParams(temperature=1.0), n=3))
    base = picked[0].sampling.seed
    assert base is not None and [r.sampling.seed for r in picked] == [derive_seed(base, i) for i in range(3)]
    assert [r.sampling.seed for r in split(req("g", [1, 2], n=2))] == [None, None]  # greedy: nothing to seed
    single = req("s", [1, 2])
    assert split(single) == [single]


def test_completion_0_alone_scores_the_prompt() -> None:
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        parts = split(req("p", [1, 2, 3], sampling=sampling, n=3, prompt_logprobs=True, prompt_top_logprobs=2))
        assert [(r.prompt_logprobs, r.prompt_top_logprobs) for r in parts] == [(True, 2), (False, 0), (False, 0)]


def test_n_is_validated() -> None:
    core = stepped_core(max_n=4)
    with pytest.raises(InvalidRequest) as err:
        validate(req("a", [1, 2, 3], n=5), core.facts)
    assert err.value.field == "n" and "--max-n" in err.value.reason
    with pytest.raises(InvalidRequest) as err:
        validate(req("a", [1, 2, 3], n=2, session_id="s"), core.facts)
    assert err.value.field == "n"
    with pytest.raises(InvalidRequest):
        validate(req("a", [1, 2, 3], n=0), core.facts)
    validate(req("a", [1, 2, 3], n=4), core.facts)


def test_the_merged_stream_keeps_each_completions_order_and_adds_the_total() -> None:
    merger = DeltaStream(2)
    first, held = merger.take([Delta("r", [1], index=0), Delta("r", [2], index=0), Delta("r", [5], index=1)])
    assert [(d.index, d.token_ids) for d in first] == [(0, [1])]  # a first token alone; what came with it is held
    assert [(d.index, d.token_ids) for d in held] == [(0, [2]), (1, [5])]
    # Held deltas join what arrives by the next read; completion 1's first token still goes alone.
    joined, held = merger.take([*held, Delta("r", [4], index=0)])
    assert [(d.index, d.token_ids) for d in joined] == [(0, [2, 4]), (1, [5])] and held == []
    done0 = Delta("r", [3], index=0, finish_reason=FinishReason.LENGTH, usage=Usage(10, 0, 4))
    second, held = merger.take([Delta("r", [6], index=1), done0])
    assert [(d.index, d.token_ids) for d in second] == [(1, [6]), (0, [3])] and held == []
    assert second[1].total_usage is None and merger.open == {1}
    done1 = Delta("r", [7], index=1, finish_reason=FinishReason.LENGTH, usage=Usage(10, 9, 3))
    (last,), _ = merger.take([Delta("r", [], index=1), done1])
    assert last.token_ids == [7] and last.total_usage == Usage(10, 0, 7) and not merger.open


@pytest.mark.parametrize("salt", [None, "alice"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_completions_compute_the_prompt_once_and_share_its_blocks(salt: str | None, prefix_caching: bool) -> None:
    core = stepped_core(
        kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=128, enable_prefix_caching=prefix_caching
    )
    spy = _Spy(core)
    prompt = _prompt(200)  # 12 full blocks and an 8-token tail
    full = len(prompt) // BS
    shared_seen: list[list[int]] = []

    def on_step() -> None:
        running = [s for s in core.scheduler.live.values() if s.status is SeqStatus.RUNNING]
        owners = [s.block_table for s in running]
        check_pool(core.pool, owners)  # the books agree with the owners after every step
        if len(running) == 4 and not shared_seen:
            shared_seen.append([core.pool.ref_count[b] for b in running[0].block_table[:full]])
            assert all(s.block_table[:full] == running[0].block_table[:full] for s in running)

    request = req("r", prompt, max_new=6, sampling=SamplingParams(temperature=1.0, seed=3), n=4, cache_salt=salt)
    deltas = _serve_n(core, request, on_step=on_step)
    assert shared_seen == [[4] * full]  # every full prompt block held by the four completions at once
    usages = [d[-1].usage for _, d in sorted(deltas.items())]
    # The others take all of the prompt's KV but its last token (the partial block copied), and compute that one.
    assert [u.cached_prompt_tokens for u in usages] == [0] + [len(prompt) - 1] * 3
    assert all(u.prompt_tokens == len(prompt) and u.completion_tokens == 6 for u in usages)
    prompt_work = sorted(spy.computed.values())  # prompt tokens computed + decode tokens (one per later token)
    assert prompt_work == [1 + 5] * 3 + [len(prompt) + 5]
    check_pool(core.pool, [])  # nothing leaked: every block back in the pool


def test_the_completions_wait_for_completion_0s_prompt_in_chunks() -> None:
    """A prompt read in several chunks: the others are not admitted (no recompute of their own) until it is done."""
    core = stepped_core(kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=64)
    spy = _Spy(core)
    prompt = _prompt(300)
    deltas = _serve_n(core, req("r", prompt, max_new=3, n=3))
    assert sorted(spy.computed.values())[:2] == [1 + 2] * 2  # the prompt's last token, then two decodes
    tokens = [[t for d in ds for t in d.token_ids] for _, ds in sorted(deltas.items())]
    assert tokens[0] == tokens[1] == tokens[2]  # greedy: n equal answers


async def test_seeded_completions_replay_and_each_equals_a_single_call_with_its_seed(engine) -> None:  # noqa: ANN001
    prompt = _prompt(150)
    request = req("n", prompt, max_new=12, sampling=SamplingParams(temperature=1.0, seed=2**63 - 2), n=4)

    async def completions() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        async with asyncio.timeout(30):
            async for delta in engine.generate(request):
                out.setdefault(delta.index, []).extend(delta.token_ids)
        return out

    first = await completions()
    assert sorted(first) == [0, 1, 2, 3] and await completions() == first
    assert len({tuple(t) for t in first.values()}) > 1  # sampled: the completions differ
    for i in range(4):
        seed = derive_seed(2**63 - 2, i)
        alone, deltas = await run(engine, req(f"one-{i}", prompt, max_new=12, sampling=SamplingParams(1.0, seed=seed)))
        assert alone == first[i] and deltas[-1].seed == seed


async def test_closing_the_stream_ends_all_n_and_leaks_no_block(engine) -> None:  # noqa: ANN001
    request = req("c", _prompt(100), max_new=400, sampling=SAMPLED, n=4)
    seen: set[int] = set()
    stream = engine.generate(request)
    async with asyncio.timeout(30):
        async for delta in stream:
            seen.add(delta.index)
            if len(seen) == 4:
                break
        await stream.aclose()
        while engine.core.engine_core.scheduler.live:
            await asyncio.sleep(0.01)
    assert engine.num_running == 0 and engine.num_waiting == 0
    core = engine.core.engine_core
    check_pool(core.pool, [])
    assert core.pool.num_free == core.pool.num_blocks


async def test_a_failed_completion_ends_the_call_and_the_others_with_it(engine) -> None:  # noqa: ANN001
    core = engine.core.engine_core
    real_hand_out = core.hand_out
    failing: list[int] = []

    def append(seq, result, now):  # noqa: ANN001, ANN202
        if not failing and seq.after is not None:
            failing.append(seq.seq_no)  # the first of completions 1..n-1 to sample
        if failing and seq.seq_no == failing[0] and seq.num_generated == 2:
            result = RowFailed("boom")
        return real_hand_out(seq, result, now)

    core.hand_out = append
    try:
        deltas = []
        async with asyncio.timeout(30):
            async for delta in engine.generate(req("f", _prompt(60), max_new=300, sampling=SAMPLED, n=3)):
                deltas.append(delta)
            while core.scheduler.live:
                await asyncio.sleep(0.01)
    finally:
        del core.hand_out
    assert deltas[-1].finish_reason is FinishReason.ERROR and deltas[-1].error == "boom"
    assert not any(d.finished for d in deltas[:-1])  # the others never finished: they were stopped
    assert deltas[-1].total_usage is None
    check_pool(core.pool, [])
