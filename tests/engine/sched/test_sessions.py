"""Session KV reuse and prefix caching: reuse never changes outputs, and memory stays bounded."""

from __future__ import annotations

import asyncio
import time

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.sched.block_pool import BlockPool, prefix_root
from llmserve.engine.sched.sessions import SessionStore
from llmserve.engine.types.outputs import Delta, FinishReason
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import clear_cache
from tests.engine.sched.pool_checks import check_pool, session_owners
from tests.testing import TINY_VOCAB, greedy_reference, tiny_config

BASE = dict(block_size=8, max_num_seqs=16, max_num_batched_tokens=128)
ROOT = prefix_root(None)  # the root the base model's unsalted requests hash under


def loaded_tiny():
    return from_config(tiny_config(max_positions=1024), dtype=torch.float64)


async def run(engine: AsyncEngine, rid: str, prompt: list[int], max_new: int, session: str | None = None):
    request = GenerationRequest(
        rid, tuple(prompt), stopping=StoppingParams(max_new_tokens=max_new, ignore_eos=True), session_id=session
    )
    tokens: list[int] = []
    last: Delta | None = None
    async with asyncio.timeout(60):  # an engine that never frees blocks or evicts fails here, not at pytest's timeout
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
            last = delta
    assert last is not None and last.finish_reason is FinishReason.LENGTH, last and last.error
    return tokens, last.usage


class Engines:
    """A warm engine with sessions and a cold one with no reuse at all, on the same weights."""

    def __init__(self, config: EngineConfig) -> None:
        loaded = loaded_tiny()
        self.warm = AsyncEngine(loaded, config)
        cold_loaded = from_config(tiny_config(max_positions=1024), dtype=torch.float64)
        cold_loaded.model.load_state_dict(loaded.model.state_dict())
        self.cold = AsyncEngine(cold_loaded, EngineConfig(**BASE, kv_cache_tokens=8192, enable_prefix_caching=False))

    async def __aenter__(self) -> Engines:
        await self.warm.start()
        await self.cold.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.warm.shutdown()
        await self.cold.shutdown()


turns = st.lists(
    st.tuples(
        st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=60),  # the new user turn
        st.integers(1, 12),  # answer length
        st.integers(0, 30),  # how many tokens of history to keep (0 = all): an edited history
    ),
    min_size=2,
    max_size=4,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=turns, prefix_caching=st.booleans())
def test_reuse_gives_exactly_the_cold_output(conversation: list, prefix_caching: bool) -> None:
    async def body() -> None:
        config = EngineConfig(**BASE, kv_cache_tokens=4096, enable_prefix_caching=prefix_caching)
        async with Engines(config) as engines:
            history: list[int] = []
            for i, (user, answer_len, cut) in enumerate(conversation):
                if cut and i % 2 == 1:
                    history = history[: max(0, len(history) - cut)]  # partial match: diverges mid-history
                prompt = history + user
                warm, usage = await run(engines.warm, f"w{i}", prompt, answer_len, session="conv")
                cold, _ = await run(engines.cold, f"c{i}", prompt, answer_len)
                assert warm == cold
                if i > 0 and not cut:
                    assert usage.cached_prompt_tokens >= len(history) - 1
                history = prompt + warm

    asyncio.run(body())


async def test_turn_two_reuses_turn_one_prompt_and_answer() -> None:
    config = EngineConfig(**BASE, kv_cache_tokens=4096)
    async with Engines(config) as engines:
        first = list(range(10, 110))
        answer, usage1 = await run(engines.warm, "t1", first, 20, session="s")
        assert usage1.cached_prompt_tokens == 0
        second = first + answer + [7, 8, 9]
        _, usage2 = await run(engines.warm, "t2", second, 5, session="s")
        assert usage2.cached_prompt_tokens >= 0.95 * (len(first) + len(answer))
        info = await engines.warm.get_session("s")
        assert info.cached_tokens == len(second) + 5 - 1


async def test_prefix_cache_shares_a_system_prompt_without_sessions() -> None:
    async with Engines(EngineConfig(**BASE, kv_cache_tokens=4096)) as engines:
        system = list(range(200, 264))  # 64 tokens: 8 full blocks
        await run(engines.warm, "a", system + [1, 2, 3], 4)
        tokens, usage = await run(engines.warm, "b", system + [4, 5], 4)
        assert usage.cached_prompt_tokens == 64
        cold, _ = await run(engines.cold, "b-cold", system + [4, 5], 4)
        assert tokens == cold


async def test_sessions_are_evicted_lru_and_live_requests_never_suffer() -> None:
    # 40 blocks of 8: each session below holds ~8 blocks, so five of them cannot all stay.
    config = EngineConfig(**BASE, kv_cache_tokens=320, session_pool_fraction=1.0, enable_prefix_caching=False)
    async with Engines(config) as engines:
        eng = engines.warm
        for i in range(6):
            await run(eng, f"s{i}", [i + 1] * 60, 4, session=f"s{i}")
        assert await eng.get_session("s5") is not None
        assert await eng.get_session("s0") is None  # least recently used went first
        kept = [i for i in range(6) if await eng.get_session(f"s{i}") is not None]
        assert kept == list(range(6 - len(kept), 6))
        # A request needing nearly the whole pool: sessions make way, nothing is preempted.
        before = eng.core.engine_core.scheduler.num_preemptions
        tokens, _ = await run(eng, "big", list(range(1, 280)), 30)
        assert len(tokens) == 30 and eng.core.engine_core.scheduler.num_preemptions == before
        cold, _ = await run(engines.cold, "big-cold", list(range(1, 280)), 30)
        assert tokens == cold


async def test_session_limits_ttl_and_delete() -> None:
    config = EngineConfig(**BASE, kv_cache_tokens=4096, session_ttl_s=0.3, max_sessions=2)
    async with Engines(config) as engines:
        eng = engines.warm
        pool = eng.core.engine_core.pool
        for i in range(3):
            await run(eng, f"m{i}", [i + 5] * 30, 3, session=f"m{i}")
        assert await eng.get_session("m0") is None and await eng.get_session("m2") is not None  # max_sessions=2
        assert await eng.delete_session("m2") is True and await eng.get_session("m2") is None
        assert await eng.delete_session("m2") is False
        await asyncio.sleep(0.4)
        assert await eng.get_session("m1") is None  # idle past the TTL
        clear_cache(pool)
        assert pool.num_free == pool.num_blocks


async def test_two_concurrent_calls_on_one_session() -> None:
    async with Engines(EngineConfig(**BASE, kv_cache_tokens=4096)) as engines:
        base = list(range(30, 75))  # 45 tokens: the last block is partly filled
        answer, _ = await run(engines.warm, "first", base, 6, session="x")
        history = base + answer
        prompts = [history + [1, 2, 3], history[:-4] + [9] * 12]
        lengths = [8, 20]
        results = await asyncio.gather(
            *(
                run(engines.warm, f"c{i}", p, n, session="x")
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
            )
        )
        for (tokens, usage), prompt, n in zip(results, prompts, lengths, strict=True):
            cold, _ = await run(engines.cold, f"cold{n}", prompt, n)
            assert tokens == cold
            assert usage.cached_prompt_tokens > 0
        # The session keeps whichever finished last: the longer answer.
        info = await engines.warm.get_session("x")
        assert info.cached_tokens == len(prompts[1]) + lengths[1] - 1


@pytest.mark.real_model
async def test_real_model_conversation_reuse_equals_cold(real_model) -> None:

    tok = real_model.tokenizer
    questions = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
    config = EngineConfig(block_size=16, kv_cache_tokens=8192, max_num_seqs=4, max_num_batched_tokens=256)
    warm = AsyncEngine(real_model, config)
    await warm.start()
    messages: list[dict[str, str]] = []
    try:
        for i, question in enumerate(questions):
            messages.append({"role": "user", "content": question})
            encoded = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompt = list(encoded["input_ids"])
            answer, usage = await run(warm, f"q{i}", prompt, 24, session="chat")
            real_model.model.set_attn_implementation("sdpa")
            try:
                cold = greedy_reference(real_model.model, prompt, 24)
            finally:
                real_model.model.set_attn_implementation("llmserve_paged")
            assert answer == cold
            if i:
                assert usage.cached_prompt_tokens > 0.8 * len(prompt) - 16
            messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
    finally:
        await warm.shutdown()


# -- the session store on its own (book-keeping over a block pool, a fake clock) -------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def store(num_blocks: int = 16, *, ttl_s: float = 10.0, max_sessions: int = 4, fraction: float = 1.0):
    pool = BlockPool(num_blocks, 4)
    clock = Clock()
    sessions = SessionStore(pool, ttl_s=ttl_s, max_sessions=max_sessions, max_pool_fraction=fraction, clock=clock)
    return pool, sessions, clock


def hold(pool: BlockPool, sessions: SessionStore, session_id: str, num_tokens: int) -> list[int]:
    """A finished call handing the KV of `num_tokens` tokens to its session."""
    blocks = pool.allocate(pool.blocks_for(num_tokens))
    sessions.retain(session_id, list(range(num_tokens)), blocks, ROOT)
    return blocks


def test_store_retains_matches_and_deletes() -> None:
    pool, sessions, clock = store()
    assert len(sessions) == 0 and "a" not in sessions and sessions.get("a") is None
    assert sessions.match("a", [1, 2, 3], ROOT) == (0, [])
    blocks = hold(pool, sessions, "a", 10)  # 3 blocks, the last one half full
    assert len(sessions) == 1 and "a" in sessions and sessions.num_blocks_held == 3
    session = sessions.get("a")
    assert (session.session_id, session.token_ids, session.blocks) == ("a", list(range(10)), blocks)
    assert session.last_used == clock.now and abs(session.last_used_wall - time.time()) < 60
    assert session_owners(sessions) == [blocks]
    check_pool(pool, session_owners(sessions))
    # The longest common prefix, and the blocks that hold it (the last one may be partly covered).
    assert sessions.match("a", list(range(10)), ROOT) == (10, blocks)
    assert sessions.match("a", list(range(12)), ROOT) == (10, blocks)
    assert sessions.match("a", [0, 1, 2, 3, 4, 9], ROOT) == (5, blocks[:2])
    assert sessions.match("a", [0, 1, 2, 3], ROOT) == (4, blocks[:1])
    assert sessions.match("a", [7], ROOT) == (0, [])
    # KV computed under another root (another LoRA adapter, another salt) is none of this request's.
    assert sessions.match("a", list(range(10)), prefix_root("other")) == (0, [])
    assert sessions.delete("a") is True and sessions.delete("a") is False
    assert len(sessions) == 0 and sessions.num_blocks_held == 0 and pool.num_free == pool.num_blocks
    check_pool(pool, [])
    assert sessions.evictions == {"memory": 0, "limit": 0, "ttl": 0}  # a delete is not an eviction


def test_store_retain_replaces_what_the_session_held_and_checks_the_block_count() -> None:
    pool, sessions, _ = store()
    hold(pool, sessions, "a", 8)
    newer = hold(pool, sessions, "a", 5)
    assert sessions.get("a").blocks == newer and sessions.num_blocks_held == 2 and len(sessions) == 1
    check_pool(pool, session_owners(sessions))
    with pytest.raises(ValueError, match="^blocks do not match the token count$"):
        sessions.retain("b", [1, 2, 3, 4, 5], pool.allocate(1), ROOT)
    assert "b" not in sessions


def test_store_match_and_retain_make_a_session_the_most_recently_used() -> None:
    pool, sessions, clock = store()
    for name in "abc":
        hold(pool, sessions, name, 4)
        clock.now += 1
    sessions.get("a").last_used_wall = 0.0
    sessions.match("a", [0], ROOT)
    assert sessions.get("a").last_used == clock.now and abs(sessions.get("a").last_used_wall - time.time()) < 60
    sessions.get("b")  # get() does not count as a use
    assert sessions.evict_one() is True
    assert "b" not in sessions and sessions.evictions["memory"] == 1
    assert sessions.evict_one() is True and "c" not in sessions
    assert sessions.evictions == {"memory": 2, "limit": 0, "ttl": 0}
    assert sessions.evict_one() is True and sessions.evict_one() is False
    assert sessions.evictions["memory"] == 3 and pool.num_free == pool.num_blocks


def test_store_evict_until_free_evicts_only_as_many_sessions_as_needed() -> None:
    pool, sessions, _ = store(num_blocks=8)
    for name in "abcd":
        hold(pool, sessions, name, 8)  # 2 blocks each: the pool is full
    assert sessions.evict_until_free(0) is True and len(sessions) == 4
    assert sessions.evict_until_free(3) is True
    assert sorted(sessions._sessions) == ["c", "d"] and pool.num_free == 4
    assert sessions.evictions["memory"] == 2
    assert sessions.evict_until_free(9) is False and len(sessions) == 0
    assert sessions.evictions["memory"] == 4


def test_store_sessions_expire_after_the_ttl_idle() -> None:
    pool, sessions, clock = store(ttl_s=10.0)
    hold(pool, sessions, "a", 4)
    clock.now += 5
    hold(pool, sessions, "b", 4)
    clock.now += 4.5
    assert sessions.expire() == 0 and len(sessions) == 2
    clock.now += 0.5  # "a" idle exactly the TTL
    assert sessions.expire() == 1 and "a" not in sessions and "b" in sessions
    assert sessions.evictions["ttl"] == 1
    sessions.match("b", [0], ROOT)  # a use restarts the clock
    clock.now += 9
    assert sessions.expire() == 0
    hold(pool, sessions, "c", 4)
    clock.now += 20
    assert sessions.expire() == 2 and len(sessions) == 0
    assert sessions.evictions == {"memory": 0, "limit": 0, "ttl": 3}
    assert pool.num_free == pool.num_blocks


def test_store_max_sessions_evicts_the_least_recently_used_never_the_new_one() -> None:
    pool, sessions, clock = store(max_sessions=2)
    hold(pool, sessions, "a", 4)
    hold(pool, sessions, "b", 4)
    assert len(sessions) == 2 and sessions.evictions["limit"] == 0
    sessions.match("a", [0], ROOT)
    hold(pool, sessions, "c", 4)
    assert sorted(sessions._sessions) == ["a", "c"] and sessions.evictions["limit"] == 1
    hold(pool, sessions, "a", 4)  # retaining an existing session adds none
    assert sorted(sessions._sessions) == ["a", "c"] and sessions.evictions["limit"] == 1
    check_pool(pool, session_owners(sessions))


def test_store_the_pool_share_evicts_others_first_then_the_session_itself() -> None:
    pool, sessions, _ = store(num_blocks=16, fraction=0.5)  # sessions may hold 8 blocks
    hold(pool, sessions, "a", 16)  # 4 blocks
    hold(pool, sessions, "b", 16)  # 8 held: exactly the share
    assert len(sessions) == 2 and sessions.num_blocks_held == 8
    hold(pool, sessions, "c", 4)  # 9 > 8: the oldest other session goes, never "c"
    assert sorted(sessions._sessions) == ["b", "c"] and sessions.num_blocks_held == 5
    assert sessions.evictions["limit"] == 1
    hold(pool, sessions, "d", 30)  # 8 blocks alone: "b" and "c" make way
    assert sorted(sessions._sessions) == ["d"] and sessions.num_blocks_held == 8
    assert sessions.evictions["limit"] == 3
    sessions.delete("d")
    hold(pool, sessions, "e", 36)  # 9 blocks: over the share on its own, so not kept at all
    assert len(sessions) == 0 and sessions.num_blocks_held == 0 and sessions.evictions["limit"] == 4
    assert pool.num_free == pool.num_blocks
    check_pool(pool, [])


def test_store_the_session_kept_over_the_limit_keeps_its_place_among_the_others() -> None:
    pool, sessions, clock = store(num_blocks=16, fraction=0.5, max_sessions=3)
    hold(pool, sessions, "a", 8)
    hold(pool, sessions, "b", 8)
    sessions.match("a", [0], ROOT)  # order now b, a
    hold(pool, sessions, "c", 20)  # 5 blocks: 9 held, evict b (not c); then 7 held
    assert sorted(sessions._sessions) == ["a", "c"] and sessions.evictions["limit"] == 1
    sessions.enforce_limits(keep="a")  # nothing over a limit: nothing happens
    assert sorted(sessions._sessions) == ["a", "c"]


def test_store_a_share_that_rounds_down_counts_whole_blocks() -> None:
    pool, sessions, _ = store(num_blocks=10, fraction=0.35)  # 3.5 -> 3 blocks
    hold(pool, sessions, "a", 12)
    assert "a" in sessions
    hold(pool, sessions, "b", 4)
    assert "a" not in sessions and "b" in sessions
