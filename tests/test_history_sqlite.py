"""The SQLite history store (server/llmserve/history/sqlite_store.py) on its own: a file that outlives the store,
its faults (locked, damaged, full) as clear StoreUnavailable errors, a lease taken by a cancelled call, and
the memory store and a SQLite store driven side by side by hypothesis, holding the same histories.
The contract it shares with the other stores is checked in test_history.py."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_history import Clock, finish, held_ids, tokens_turn

from llmserve.api.prompts import continue_tokens
from llmserve.engine.types.outputs import FinishReason
from llmserve.history import (
    HistoryBusy,
    HistoryConfig,
    HistoryInput,
    MemoryHistoryStore,
    NoHistory,
    StoreUnavailable,
    Turn,
    open_store,
)
from llmserve.history.sqlite_store import SqliteHistoryStore

CAP = 64  # the per-session token cap the state machine's turns begin with


async def test_a_start_cancelled_midway_frees_its_lease(tmp_path: Path) -> None:
    """A caller that goes away while its continuing call is taking the lease leaves the session free at once,
    not for --history-lease: the store call lands, then the lease is released. The call is held inside SQLite
    (another connection holds the write lock) while the caller is cancelled."""
    path = tmp_path / "h.db"
    store = SqliteHistoryStore(HistoryConfig(lease_s=600), path)
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


async def test_sqlite_histories_survive_the_store_and_open_store_reads_the_spec(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "sessions.db"
    store = open_store(HistoryConfig(store=f"sqlite:{path}"))
    assert isinstance(store, SqliteHistoryStore)
    await store.connect()
    await tokens_turn(store, "s", [1, 2], [3])
    await store.close()
    again = open_store(HistoryConfig(store=f"sqlite:{path}"))
    await again.connect()
    assert await held_ids(again, "s") == [1, 2, 3]
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    await again.close()
    assert isinstance(open_store(HistoryConfig(store="memory")), MemoryHistoryStore)


async def test_a_locked_sqlite_file_fails_the_call_naming_it_and_the_next_call_works(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    store = SqliteHistoryStore(HistoryConfig(), path, busy_timeout_s=0.2)
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
    store = SqliteHistoryStore(HistoryConfig(), path)
    await tokens_turn(store, "s", [1], [2])
    await store.close()
    for name in (path, path.with_name("h.db-wal"), path.with_name("h.db-shm")):
        if name.exists():
            name.write_bytes(b"\x00garbage" * 1000)
    store = SqliteHistoryStore(HistoryConfig(), path)
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
    store = SqliteHistoryStore(HistoryConfig(), tmp_path / "h.db")
    await tokens_turn(store, "s", [1], [2])
    pages = await store._call("cap", lambda conn: conn.execute("PRAGMA page_count").fetchone()[0])
    await store._call("cap", lambda conn: conn.execute(f"PRAGMA max_page_count = {pages}").fetchone())
    turn = await store.start("s", "r", continues=True)
    turn.begin(HistoryInput.TOKENS, continue_tokens(turn, list(range(20_000)), "token_ids"))
    with pytest.raises(StoreUnavailable, match="full"):
        await finish(turn, [3])
    assert await held_ids(store, "s") == [1, 2]
    await (await store.start("s", "retry", continues=True)).release()  # the failed call freed its lease
    await store.close()


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
        self.memory = MemoryHistoryStore(self.config, clock=self.clock)
        self.sqlite = SqliteHistoryStore(self.config, Path(self.folder.name) / "h.db", clock=self.clock)
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
            turn.begin(HistoryInput.TOKENS, prompt, max_tokens=CAP)
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
            for turn in outcomes:
                turn.begin(HistoryInput.TOKENS, continue_tokens(turn, new, "token_ids"), max_tokens=CAP)
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
