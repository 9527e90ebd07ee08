"""The session history stores (server/llmserve/history/): one contract, checked against each real store.

Every test runs against the memory store, a SQLite file in a temporary folder and a real redis-server on a
loopback port (tests/redis_server.py). Tests that move a clock run where the clock can be moved (memory,
SQLite); Redis keeps its own time, so its TTL is checked with a short real TTL.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer

from llmserve.api.prompts import continue_chat, continue_tokens
from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.outputs import Delta, FinishReason
from llmserve.history import (
    HistoryBusy,
    HistoryConfig,
    HistoryInput,
    HistoryStore,
    LeaseLost,
    MemoryHistoryStore,
    NoHistory,
    Turn,
)
from llmserve.history.redis_store import RedisHistoryStore
from llmserve.history.sqlite_store import SqliteHistoryStore

KINDS = ["memory", "sqlite", "redis"]


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    srv = RedisServer()
    yield srv
    srv.stop()


Make = Callable[..., HistoryStore]


@pytest.fixture(params=KINDS)
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Make]:
    """A factory of connected stores of one kind; stores made by one test share one backing store (one SQLite
    file, one Redis), as the replicas of a deployment do."""
    kind = request.param
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        if server.proc is None:
            server.start()
        server.flush()
    made: list[HistoryStore] = []

    def factory(config: HistoryConfig | None = None, clock: Clock | None = None) -> Any:
        config = config or HistoryConfig()
        store: HistoryStore
        if kind == "memory":
            if made:
                pytest.skip("a memory store is one process's own")
            store = MemoryHistoryStore(config, clock=clock or Clock())
        elif kind == "sqlite":
            store = SqliteHistoryStore(config, tmp_path / "h.db", clock=clock or Clock())
        else:
            if clock is not None:
                pytest.skip("Redis keeps its own clock")
            store = RedisHistoryStore(config, server.url)
        made.append(store)
        return store

    factory.kind = kind  # type: ignore[attr-defined]
    yield factory
    for store in made:
        await store.close()


async def finish(turn: Turn, ids: list[int], text: str = "", reason: FinishReason = FinishReason.EOS) -> None:
    """Feed the turn an answer the way the servicer does: deltas, the last one with a finish reason."""
    try:
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            await turn.observe(Delta("r", [token], text if last else "", finish_reason=reason if last else None))
    finally:
        await turn.release()


async def tokens_turn(
    store: HistoryStore, key: str, prompt: list[int], answer: list[int], continues: bool = False, cap: int = 1000
) -> None:
    turn = await store.start(key, f"req-{key}", continues=continues)
    ids = continue_tokens(turn, prompt, "token_ids") if continues else prompt
    turn.begin(HistoryInput.TOKENS, ids, max_tokens=cap)
    await finish(turn, answer)


async def held_ids(store: HistoryStore, key: str) -> list[int] | None:
    held = await store.get(key)
    return None if held is None else list(held.token_ids)


async def test_tokens_history_is_prompt_then_answer_and_continuing_appends(make: Make) -> None:
    store = make()
    await store.connect()
    await tokens_turn(store, "s", [1, 2, 3], [4, 5])
    held = await store.get("s")
    assert held is not None and list(held.token_ids) == [1, 2, 3, 4, 5] and held.turns == 1
    await tokens_turn(store, "s", [6], [7], continues=True)
    held = await store.get("s")
    assert held is not None and list(held.token_ids) == [1, 2, 3, 4, 5, 6, 7] and held.turns == 2
    assert held.kind is HistoryInput.TOKENS


async def test_chat_history_holds_the_answer_as_an_assistant_message(make: Make) -> None:
    store = make()
    turn = await store.start("c", "r1", continues=False)
    turn.begin(HistoryInput.CHAT, [10, 11], [("system", "Be brief."), ("user", "Hï")])
    await finish(turn, [12, 13], text="Héllo!")
    turn = await store.start("c", "r2", continues=True)
    composed = continue_chat(turn, [("user", "Bye")])
    assert composed == [("system", "Be brief."), ("user", "Hï"), ("assistant", "Héllo!"), ("user", "Bye")]
    await turn.release()
    held = await store.get("c")
    assert held is not None and held.turns == 1 and list(held.token_ids) == [10, 11, 12, 13]


async def test_kinds_do_not_mix(make: Make) -> None:
    store = make()
    await tokens_turn(store, "t", [1], [2])
    turn = await store.start("t", "r", continues=True)
    with pytest.raises(InvalidRequest) as err:
        continue_chat(turn, [("user", "x")])
    assert err.value.field == "chat"
    await turn.release()
    turn = await store.start("c", "r", continues=False)
    turn.begin(HistoryInput.CHAT, [1], [("user", "x")])
    await finish(turn, [2])
    turn = await store.start("c", "r2", continues=True)
    with pytest.raises(InvalidRequest) as err:
        continue_tokens(turn, [3], "text")
    assert err.value.field == "text"
    await turn.release()


async def test_a_cut_short_turn_leaves_the_history_as_it_was(make: Make) -> None:
    store = make()
    await tokens_turn(store, "s", [1], [2])
    for reason in (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR):
        turn = await store.start("s", "r", continues=True)
        turn.begin(HistoryInput.TOKENS, continue_tokens(turn, [3], "token_ids"))
        await finish(turn, [4], reason=reason)
        assert await held_ids(store, "s") == [1, 2]


async def test_one_continuing_call_at_a_time_and_plain_calls_are_never_refused(make: Make) -> None:
    store = make()
    await tokens_turn(store, "s", [1], [2])
    first = await store.start("s", "first", continues=True)
    with pytest.raises(HistoryBusy) as err:
        await store.start("s", "second", continues=True)
    assert err.value.request_id == "first"
    await (await store.start("s", "plain", continues=False)).release()
    await first.release()
    await (await store.start("s", "second", continues=True)).release()


async def test_one_continuing_call_at_a_time_across_processes_sharing_the_store(make: Make) -> None:
    """Two stores on one SQLite file or one Redis, as two replicas have: the lease holds across them, a commit
    on one is read by the other, and the winner's turn is the whole history (never a mix)."""
    a, b = make(), make()
    await tokens_turn(a, "s", [1], [2])
    first = await a.start("s", "on-a", continues=True)
    with pytest.raises(HistoryBusy) as err:
        await b.start("s", "on-b", continues=True)
    assert err.value.request_id == "on-a"
    first.begin(HistoryInput.TOKENS, continue_tokens(first, [3], "token_ids"))
    await finish(first, [4])
    assert await held_ids(b, "s") == [1, 2, 3, 4]
    await tokens_turn(b, "s", [5], [6], continues=True)
    assert await held_ids(a, "s") == [1, 2, 3, 4, 5, 6]


async def test_racing_continuations_on_two_stores_one_wins_never_a_mix(make: Make) -> None:
    a, b = make(), make()
    await tokens_turn(a, "s", [0], [0])
    expected = [0, 0]
    for i in range(1, 40):

        async def attempt(store: HistoryStore, mark: int) -> int | None:
            try:
                turn = await store.start("s", f"r{mark}", continues=True)
            except HistoryBusy:
                return None
            turn.begin(HistoryInput.TOKENS, continue_tokens(turn, [mark], "token_ids"))
            await asyncio.sleep(0)
            await finish(turn, [mark])
            return mark

        won = [m for m in await asyncio.gather(attempt(a, i), attempt(b, -i)) if m is not None]
        assert len(won) >= 1
        held = await held_ids(a, "s")
        # The two may also run one after the other (the first finished before the second started), in either
        # order; each turn is whole, on top of the whole history before it.
        orders = [[m for mark in order for m in (mark, mark)] for order in itertools.permutations(won)]
        assert held in [expected + order for order in orders], (i, won, held)
        expected = held


async def test_a_lapsed_lease_is_taken_over_and_its_late_commit_writes_nothing(make: Make) -> None:
    if make.kind == "memory":  # type: ignore[attr-defined]
        pytest.skip("a memory store's calls cannot outlive their process")
    store = make(HistoryConfig(lease_s=0.3))
    await tokens_turn(store, "s", [1], [2])
    paused = await store.start("s", "paused", continues=True)
    paused.begin(HistoryInput.TOKENS, continue_tokens(paused, [3], "token_ids"))
    store.stop_renewal(paused)  # type: ignore[attr-defined]  # as a frozen or crashed holder stops renewing
    if isinstance(store, SqliteHistoryStore):
        store._clock.now += 1.0  # type: ignore[attr-defined]
    else:
        await asyncio.sleep(0.6)
    late = await store.start("s", "later", continues=True)
    late.begin(HistoryInput.TOKENS, continue_tokens(late, [5], "token_ids"))
    with pytest.raises(LeaseLost):
        await finish(paused, [4])
    await finish(late, [6])
    assert await held_ids(store, "s") == [1, 2, 5, 6]


async def test_a_running_call_renews_its_lease(make: Make) -> None:
    if make.kind != "redis":  # type: ignore[attr-defined]
        pytest.skip("Redis expires leases on its own clock; the others are checked with a moved clock above")
    store = make(HistoryConfig(lease_s=0.3))
    await tokens_turn(store, "s", [1], [2])
    turn = await store.start("s", "long", continues=True)
    await asyncio.sleep(0.9)  # three leases: renewed every 0.1 s
    with pytest.raises(HistoryBusy):
        await store.start("s", "other", continues=True)
    turn.begin(HistoryInput.TOKENS, continue_tokens(turn, [3], "token_ids"))
    await finish(turn, [4])
    assert await held_ids(store, "s") == [1, 2, 3, 4]


async def test_missing_history_says_why_it_ended(make: Make) -> None:
    clock = Clock()
    if make.kind == "redis":  # type: ignore[attr-defined]
        store = make(HistoryConfig(ttl_s=1.0, max_sessions=2))
    else:
        store = make(HistoryConfig(ttl_s=10, max_sessions=2), clock=clock)
    with pytest.raises(NoHistory) as err:
        await store.start("never", "r", continues=True)
    assert err.value.reason is None
    await tokens_turn(store, "a", [1], [2])
    assert await store.delete("a") and not await store.delete("a")
    with pytest.raises(NoHistory, match="deleted"):
        await store.start("a", "r", continues=True)
    for key in "cde":
        await tokens_turn(store, key, [1], [2])
    with pytest.raises(NoHistory, match="--max-sessions"):
        await store.start("c", "r", continues=True)
    await tokens_turn(store, "f", [1] * 6, [2, 3], cap=8)  # 8 tokens: reaches the cap
    with pytest.raises(NoHistory, match="--max-session-tokens"):
        await store.start("f", "r", continues=True)
    # A new history under an ended key starts afresh.
    await tokens_turn(store, "f", [1], [2])
    assert await store.get("f") is not None
    clock.now += 11
    if make.kind == "redis":  # type: ignore[attr-defined]
        await asyncio.sleep(1.3)
    with pytest.raises(NoHistory, match="--session-ttl"):
        await store.start("f", "r", continues=True)


async def test_byte_cap_evicts_least_recently_used_first(make: Make) -> None:
    store = make(HistoryConfig(max_bytes=1))
    await tokens_turn(store, "alone", [1] * 100, [2])
    assert await store.get("alone") is None, "a history over the cap on its own is not kept"
    await store.close()
    if isinstance(store, SqliteHistoryStore):
        store.path.unlink()
    store = make(HistoryConfig(max_bytes=3 * 1024))
    clock = getattr(store, "_clock", None)
    for key in "abcd":
        if isinstance(clock, Clock):
            clock.now += 1
        await tokens_turn(store, key, [1] * 100, [2])  # 660 bytes each
    if isinstance(clock, Clock):
        clock.now += 1
    await (await store.start("a", "r", continues=True)).release()  # a is now the most recently used
    if isinstance(clock, Clock):
        clock.now += 1
    await tokens_turn(store, "e", [1] * 100, [2])
    assert await store.get("b") is None and await store.get("a") is not None and await store.get("e") is not None
    with pytest.raises(NoHistory, match="--session-history-mib"):
        await store.start("b", "r", continues=True)


async def test_delete_during_a_call_writes_no_history(make: Make) -> None:
    store = make()
    await tokens_turn(store, "s", [1], [2])
    for continues in (True, False):
        await tokens_turn(store, "s", [1], [2])
        turn = await store.start("s", "r", continues=continues)
        turn.begin(HistoryInput.TOKENS, continue_tokens(turn, [3], "token_ids") if continues else [3])
        assert await store.delete("s")
        await finish(turn, [4])
        assert await store.get("s") is None
