"""The session history stores (server/llmserve/history/): one contract, checked against each real store.

Every test runs against the memory store, a SQLite file in a temporary folder and a real redis-server on a
loopback port (tests/redis_server.py). Tests that move a clock run where the clock can be moved (memory,
SQLite); Redis keeps its own time, so its TTL is checked with a short real TTL.
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from redis_server import RedisServer

from llmserve.engine.request import Delta, FinishReason, InvalidRequest
from llmserve.history import (
    HistoryBusy,
    HistoryConfig,
    HistoryInput,
    HistoryStore,
    LeaseLost,
    MemoryHistoryStore,
    NoHistory,
    StoreUnavailable,
    Turn,
    open_store,
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

    def factory(config: HistoryConfig | None = None, max_tokens: int = 1000, clock: Clock | None = None) -> Any:
        config = config or HistoryConfig()
        store: HistoryStore
        if kind == "memory":
            if made:
                pytest.skip("a memory store is one process's own")
            store = MemoryHistoryStore(config, max_tokens=max_tokens, clock=clock or Clock())
        elif kind == "sqlite":
            store = SqliteHistoryStore(config, tmp_path / "h.db", max_tokens=max_tokens, clock=clock or Clock())
        else:
            if clock is not None:
                pytest.skip("Redis keeps its own clock")
            store = RedisHistoryStore(config, server.url, max_tokens=max_tokens)
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
    store: HistoryStore, key: str, prompt: list[int], answer: list[int], continues: bool = False
) -> None:
    turn = await store.start(key, f"req-{key}", continues=continues)
    ids = store.continue_tokens(turn, prompt, "token_ids") if continues else prompt
    turn.begin(HistoryInput.TOKENS, ids)
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
    composed = store.continue_chat(turn, [("user", "Bye")])
    assert composed == [("system", "Be brief."), ("user", "Hï"), ("assistant", "Héllo!"), ("user", "Bye")]
    await turn.release()
    held = await store.get("c")
    assert held is not None and held.turns == 1 and list(held.token_ids) == [10, 11, 12, 13]


async def test_kinds_do_not_mix(make: Make) -> None:
    store = make()
    await tokens_turn(store, "t", [1], [2])
    turn = await store.start("t", "r", continues=True)
    with pytest.raises(InvalidRequest) as err:
        store.continue_chat(turn, [("user", "x")])
    assert err.value.field == "chat"
    await turn.release()
    turn = await store.start("c", "r", continues=False)
    turn.begin(HistoryInput.CHAT, [1], [("user", "x")])
    await finish(turn, [2])
    turn = await store.start("c", "r2", continues=True)
    with pytest.raises(InvalidRequest) as err:
        store.continue_tokens(turn, [3], "text")
    assert err.value.field == "text"
    await turn.release()


async def test_a_cut_short_turn_leaves_the_history_as_it_was(make: Make) -> None:
    store = make()
    await tokens_turn(store, "s", [1], [2])
    for reason in (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR):
        turn = await store.start("s", "r", continues=True)
        turn.begin(HistoryInput.TOKENS, store.continue_tokens(turn, [3], "token_ids"))
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
    first.begin(HistoryInput.TOKENS, a.continue_tokens(first, [3], "token_ids"))
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
            turn.begin(HistoryInput.TOKENS, store.continue_tokens(turn, [mark], "token_ids"))
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
    paused.begin(HistoryInput.TOKENS, store.continue_tokens(paused, [3], "token_ids"))
    store.stop_renewal(paused)  # type: ignore[attr-defined]  # as a frozen or crashed holder stops renewing
    if isinstance(store, SqliteHistoryStore):
        store._clock.now += 1.0  # type: ignore[attr-defined]
    else:
        await asyncio.sleep(0.6)
    late = await store.start("s", "later", continues=True)
    late.begin(HistoryInput.TOKENS, store.continue_tokens(late, [5], "token_ids"))
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
    turn.begin(HistoryInput.TOKENS, store.continue_tokens(turn, [3], "token_ids"))
    await finish(turn, [4])
    assert await held_ids(store, "s") == [1, 2, 3, 4]


async def test_a_start_cancelled_midway_frees_its_lease(tmp_path: Path) -> None:
    """A caller that goes away while its continuing call is taking the lease leaves the session free at once,
    not for --history-lease: the store call lands, then the lease is released. The call is held inside SQLite
    (another connection holds the write lock) while the caller is cancelled."""
    path = tmp_path / "h.db"
    store = SqliteHistoryStore(HistoryConfig(lease_s=600), path, max_tokens=100)
    await tokens_turn(store, "s", [1], [2])
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    task = asyncio.ensure_future(store.start("s", "gone", continues=True))
    await asyncio.sleep(0.3)  # the store's thread now waits on the lock, inside the lease's transaction
    task.cancel()
    blocker.execute("ROLLBACK")
    blocker.close()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(500):
        try:
            await (await store.start("s", "next", continues=True)).release()
            break
        except HistoryBusy:
            await asyncio.sleep(0.01)
    else:
        pytest.fail("the cancelled call's lease still holds the session")
    await store.close()


async def test_missing_history_says_why_it_ended(make: Make) -> None:
    clock = Clock()
    if make.kind == "redis":  # type: ignore[attr-defined]
        store = make(HistoryConfig(ttl_s=1.0, max_sessions=2), max_tokens=8)
    else:
        store = make(HistoryConfig(ttl_s=10, max_sessions=2), max_tokens=8, clock=clock)
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
    await tokens_turn(store, "f", [1] * 6, [2, 3])  # 8 tokens: reaches the cap
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


def test_continued_prompt_over_the_token_cap_is_refused_naming_the_flag() -> None:
    store = MemoryHistoryStore(HistoryConfig(max_tokens=5))
    store.check_length(5)
    with pytest.raises(InvalidRequest, match="--max-session-tokens") as err:
        store.check_length(6)
    assert err.value.field == "continue_session"


async def test_byte_cap_evicts_least_recently_used_first(make: Make) -> None:
    store = make(HistoryConfig(max_bytes=1), max_tokens=10_000)
    await tokens_turn(store, "alone", [1] * 100, [2])
    assert await store.get("alone") is None, "a history over the cap on its own is not kept"
    await store.close()
    if isinstance(store, SqliteHistoryStore):
        store.path.unlink()
    store = make(HistoryConfig(max_bytes=3 * 1024), max_tokens=10_000)
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
        turn.begin(HistoryInput.TOKENS, store.continue_tokens(turn, [3], "token_ids") if continues else [3])
        assert await store.delete("s")
        await finish(turn, [4])
        assert await store.get("s") is None


async def test_sqlite_histories_survive_the_store_and_open_store_reads_the_spec(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "sessions.db"
    store = open_store(HistoryConfig(store=f"sqlite:{path}"), max_tokens=100)
    assert isinstance(store, SqliteHistoryStore)
    await store.connect()
    await tokens_turn(store, "s", [1, 2], [3])
    await store.close()
    again = open_store(HistoryConfig(store=f"sqlite:{path}"), max_tokens=100)
    await again.connect()
    assert await held_ids(again, "s") == [1, 2, 3]
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    await again.close()
    assert isinstance(open_store(HistoryConfig(store="memory")), MemoryHistoryStore)


class DifferentialMachine(RuleBasedStateMachine):
    """Random calls, deletions and clock steps on the memory store and a SQLite store with one clock: both
    hold the same histories after every step, and the limits and the byte count hold in both."""

    keys = "abcde"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        # A lease longer than any test: the memory store's calls hold their session until they end.
        self.config = HistoryConfig(ttl_s=50, max_sessions=3, max_bytes=2048, lease_s=1e9)
        self.folder = tempfile.TemporaryDirectory()
        self.memory = MemoryHistoryStore(self.config, max_tokens=64, clock=self.clock)
        self.sqlite = SqliteHistoryStore(self.config, Path(self.folder.name) / "h.db", max_tokens=64, clock=self.clock)
        self.open: list[tuple[Turn, Turn]] = []
        self.ids = itertools.count()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        for pair in self.open:
            for turn in pair:
                self.run(turn.release())
        self.run(self.sqlite.close())
        self.loop.close()
        self.folder.cleanup()

    def _step(self) -> None:
        self.clock.now += 0.001  # distinct times: both stores order the LRU by last use

    @rule(key=st.sampled_from(keys), prompt=st.lists(st.integers(0, 99), min_size=1, max_size=40))
    def start_plain(self, key: str, prompt: list[int]) -> None:
        self._step()
        pair = tuple(self.run(s.start(key, "r", continues=False)) for s in (self.memory, self.sqlite))
        for turn in pair:
            turn.begin(HistoryInput.TOKENS, prompt)
        self.open.append(pair)  # type: ignore[arg-type]

    @rule(key=st.sampled_from(keys), new=st.lists(st.integers(0, 99), min_size=1, max_size=8))
    def start_continuing(self, key: str, new: list[int]) -> None:
        self._step()
        outcomes = []
        for store in (self.memory, self.sqlite):
            try:
                outcomes.append(self.run(store.start(key, f"r{next(self.ids)}", continues=True)))
            except (NoHistory, HistoryBusy) as exc:
                outcomes.append(type(exc))
        assert [o if isinstance(o, type) else Turn for o in outcomes] == [
            o if isinstance(o, type) else Turn for o in reversed(outcomes)
        ], outcomes
        if isinstance(outcomes[0], Turn):
            for store, turn in zip((self.memory, self.sqlite), outcomes, strict=True):
                turn.begin(HistoryInput.TOKENS, store.continue_tokens(turn, new, "token_ids"))
            self.open.append((outcomes[0], outcomes[1]))

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 10), answer=st.lists(st.integers(0, 99), min_size=1, max_size=8), ok=st.booleans())
    def finish_one(self, i: int, answer: list[int], ok: bool) -> None:
        self._step()
        for turn in self.open.pop(i % len(self.open)):
            self.run(finish(turn, answer, reason=FinishReason.EOS if ok else FinishReason.CANCELLED))

    @rule(key=st.sampled_from(keys))
    def delete(self, key: str) -> None:
        self._step()
        assert self.run(self.memory.delete(key)) == self.run(self.sqlite.delete(key))

    @rule(dt=st.floats(0, 30))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @invariant()
    def same_histories_within_limits(self) -> None:
        held = {}
        for key in self.keys:
            m, s = self.run(self.memory.get(key)), self.run(self.sqlite.get(key))
            assert (m is None) == (s is None), key
            if m is not None:
                assert (list(m.token_ids), m.turns, m.nbytes) == (list(s.token_ids), s.turns, s.nbytes), key
                held[key] = m
        assert self.memory.nbytes == sum(h.nbytes for h in held.values())
        assert len(held) == len(self.memory) <= self.config.max_sessions
        assert self.memory.nbytes <= self.config.max_bytes
        assert all(len(h.token_ids) < 64 for h in held.values())


TestDifferentialMachine = DifferentialMachine.TestCase
TestDifferentialMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


async def test_a_locked_sqlite_file_fails_the_call_naming_it_and_the_next_call_works(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    store = SqliteHistoryStore(HistoryConfig(), path, max_tokens=100, busy_timeout_s=0.2)
    await tokens_turn(store, "s", [1], [2])
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process writing, or stuck
    try:
        with pytest.raises(StoreUnavailable, match="locked") as err:
            await store.start("s", "r", continues=True)
        assert f"sqlite:{path}" in str(err.value) and "write lock" in str(err.value)
        assert store.stats["start"].errors == 1
    finally:
        other.execute("ROLLBACK")
        other.close()
    await tokens_turn(store, "s", [3], [4], continues=True)
    assert await held_ids(store, "s") == [1, 2, 3, 4]
    await store.close()


async def test_a_damaged_sqlite_file_fails_each_call_naming_it_and_never_crashes(tmp_path: Path) -> None:
    """The file damaged under a running server (here: before the store's first call, which opens it lazily, as
    a server started with --history-store-optional does): every call fails StoreUnavailable naming the file and
    saying it is damaged; the start-up check says the same."""
    path = tmp_path / "h.db"
    store = SqliteHistoryStore(HistoryConfig(), path, max_tokens=100)
    await tokens_turn(store, "s", [1], [2])
    await store.close()
    for name in (path, path.with_name("h.db-wal"), path.with_name("h.db-shm")):
        if name.exists():
            name.write_bytes(b"\x00garbage" * 1000)
    store = SqliteHistoryStore(HistoryConfig(), path, max_tokens=100)
    for call in (store.start("s", "r", continues=True), store.get("s"), store.delete("s")):
        with pytest.raises(StoreUnavailable, match="damaged") as err:
            await call
        assert f"sqlite:{path}" in str(err.value)
    assert store.stats["start"].errors == store.stats["get"].errors == 1
    await store.close()
    with pytest.raises(StoreUnavailable, match="damaged"):
        await SqliteHistoryStore(HistoryConfig(), path).connect()


async def test_a_full_sqlite_file_fails_the_commit_and_keeps_the_earlier_turn(tmp_path: Path) -> None:
    """A full disk, as SQLite reports it (the file capped at its current pages with max_page_count): the commit
    fails StoreUnavailable saying so, nothing half written, the earlier turn intact."""
    store = SqliteHistoryStore(HistoryConfig(), tmp_path / "h.db", max_tokens=100_000)
    await tokens_turn(store, "s", [1], [2])
    pages = await store._call("cap", lambda conn: conn.execute("PRAGMA page_count").fetchone()[0])
    await store._call("cap", lambda conn: conn.execute(f"PRAGMA max_page_count = {pages}").fetchone())
    turn = await store.start("s", "r", continues=True)
    turn.begin(HistoryInput.TOKENS, store.continue_tokens(turn, list(range(20_000)), "token_ids"))
    with pytest.raises(StoreUnavailable, match="full"):
        await finish(turn, [3])
    assert await held_ids(store, "s") == [1, 2]
    await (await store.start("s", "retry", continues=True)).release()  # the failed call freed its lease
    await store.close()
