"""The SQLite history store (`--history-store sqlite:PATH`): histories that survive a restart of the server.

One table, one row per session key: the history when one is held, else why the last one ended (the
NOT_FOUND reason); the session's deletion count (`epoch`); and the lease of the call continuing it. Every
write is one `BEGIN IMMEDIATE` transaction, so a turn is committed whole or not at all, and processes sharing
the file (WAL mode) see one continuing call per session: the lease is taken and checked inside the
transaction. Commits are `synchronous=FULL`: a committed turn survives a crash of the machine too (leases
are not synced: see `_write`).

Calls run on one thread of the store's own, off the event loop; `busy_timeout` bounds how long a write waits
for another process's lock before the call fails UNAVAILABLE naming the file. TTL: rows idle for longer are
dropped (with their reason kept) by every commit, and treated as gone by every read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from llmserve.history.codec import ids_from_bytes, ids_to_bytes
from llmserve.history.config import MAX_TOMBSTONES, HistoryConfig
from llmserve.history.errors import HistoryBusy, LeaseLost, NoHistory, StoreUnavailable
from llmserve.history.lease import LeasedStore
from llmserve.history.reasons import reason_bytes, reason_count, reason_deleted, reason_ttl
from llmserve.history.records import Finished, History, HistoryInput, Turn, footprint

T = TypeVar("T")
SCHEMA_VERSION = 1
# How long a write waits for another process's write lock before the call fails (SQLite's busy_timeout).
BUSY_TIMEOUT_S = 5.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    key TEXT PRIMARY KEY,
    kind TEXT,                 -- NULL: no history held (`ended` says why)
    turns INTEGER NOT NULL DEFAULT 0,
    ids BLOB,
    messages TEXT,
    nbytes INTEGER NOT NULL DEFAULT 0,
    last_used REAL,
    ended TEXT,
    ended_at REAL,
    epoch INTEGER NOT NULL DEFAULT 0,
    lease TEXT,
    lease_holder TEXT,
    lease_until REAL
);
CREATE INDEX IF NOT EXISTS sessions_lru ON sessions (last_used) WHERE kind IS NOT NULL;
CREATE INDEX IF NOT EXISTS sessions_ended ON sessions (ended_at) WHERE kind IS NULL;
CREATE TABLE IF NOT EXISTS totals (id INTEGER PRIMARY KEY CHECK (id = 1), sessions INTEGER, nbytes INTEGER);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
"""
_ROW = "kind, turns, ids, messages, last_used, ended, epoch, lease, lease_holder, lease_until"


class SqliteHistoryStore(LeasedStore):
    """Histories in one SQLite file, shared safely by the processes that open it."""

    kind = "sqlite"

    def __init__(
        self,
        config: HistoryConfig,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
    ) -> None:
        super().__init__(config)
        self.path = Path(path).expanduser()
        self.name = f"sqlite:{self.path}"
        self._clock = clock
        self._busy_timeout_s = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="history-sqlite")

    # -- the async interface ---------------------------------------------------------------------------

    async def connect(self) -> None:
        await self._call("connect", self._check)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._thread, self._close)
        self._thread.shutdown(wait=False)

    async def get(self, key: str) -> History | None:
        row = await self._call("get", _read, key)
        if row is None or row["kind"] is None or self._expired(row):
            return None
        return self._history(row)

    async def start(self, key: str, request_id: str, *, continues: bool) -> Turn:
        if not continues:
            row = await self._call("start", _read, key)
            return Turn(self, key, request_id, None, epoch=row["epoch"] if row is not None else 0)
        token = self.new_token()
        epoch, taken = await self.leased(self._call("start", self._take, key, request_id, token), key, token)
        turn = Turn(self, key, request_id, self._history(taken), epoch=epoch, lease=token)
        self.hold(turn)
        return turn

    async def commit(self, turn: Turn) -> None:
        self.stop_renewal(turn)
        await self._call("commit", self._commit, turn.key, turn.lease, turn.epoch, turn.finished())
        turn.lease = None  # freed by the commit; a failed commit leaves it to release()

    async def delete(self, key: str) -> bool:
        return await self._call("delete", self._delete, key)

    async def _renew(self, key: str, token: str) -> bool:
        return await self._call("renew", self._renew_in, key, token)

    async def _release_lease(self, key: str, token: str) -> None:
        await self._call("release", self._release_in, key, token)

    # -- on the store's thread -------------------------------------------------------------------------

    async def _call(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        with self.timed(op):
            if self._closed:
                raise StoreUnavailable(self.name, "the store was closed (the server is stopping)")
            run = functools.partial(self._in_thread, fn, *args)
            return await asyncio.get_running_loop().run_in_executor(self._thread, run)

    def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(self._open(), *args)
        except sqlite3.Error as exc:
            if not isinstance(exc, sqlite3.OperationalError) or "locked" not in str(exc):
                self._close()  # a corrupt or vanished file: open it afresh on the next call
            raise StoreUnavailable(self.name, _explain(exc, self._busy_timeout_s)) from None

    def _open(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False)
        try:
            conn.row_factory = sqlite3.Row
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise sqlite3.OperationalError(f"cannot use WAL mode (journal mode {mode})")
            conn.execute("PRAGMA synchronous=FULL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}, this server writes {SCHEMA_VERSION}")
            with _write(conn):
                _schema(conn)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def _check(self, conn: sqlite3.Connection) -> None:
        result = conn.execute("PRAGMA quick_check").fetchone()[0]
        if result != "ok":
            raise sqlite3.DatabaseError(f"the file fails SQLite's integrity check: {result}")

    def _take(self, conn: sqlite3.Connection, key: str, request_id: str, token: str) -> tuple[int, sqlite3.Row]:
        now = self._clock()
        with _write(conn, durable=False):
            row = _read(conn, key)
            if row is not None and row["lease"] is not None and row["lease_until"] > now:
                raise HistoryBusy(key, row["lease_holder"])
            if row is not None and self._expired(row, now):
                self._drop(conn, key, reason_ttl(self.config.ttl_s), now)
                row = _read(conn, key)
            if row is None or row["kind"] is None:
                raise NoHistory(key, row["ended"] if row is not None else None)
            conn.execute(
                "UPDATE sessions SET lease = ?, lease_holder = ?, lease_until = ?, last_used = ? WHERE key = ?",
                (token, request_id, now + self.config.lease_s, now, key),
            )
            taken = _read(conn, key)
            assert taken is not None  # updated above, in this transaction
            return row["epoch"], taken

    def _commit(self, conn: sqlite3.Connection, key: str, token: str | None, epoch: int, done: Finished) -> None:
        now = self._clock()
        with _write(conn):
            row = _read(conn, key)
            if token is not None:
                if row is None or row["lease"] != token:
                    raise LeaseLost(key)
                conn.execute("UPDATE sessions SET lease = NULL, lease_holder = NULL WHERE key = ?", (key,))
            if (row["epoch"] if row is not None else 0) != epoch:
                return  # deleted since the turn began: write nothing
            self._expire(conn, now)
            self._drop(conn, key, None, now)
            if done.end_reason is not None:
                self._end(conn, key, done.end_reason, now)
                return
            messages = json.dumps(done.messages, ensure_ascii=False) if done.kind is HistoryInput.CHAT else None
            nbytes = footprint(done.token_ids, done.messages)
            conn.execute(
                "INSERT INTO sessions (key, kind, turns, ids, messages, nbytes, last_used) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (key) DO UPDATE SET kind = excluded.kind, turns = excluded.turns, ids = excluded.ids,"
                " messages = excluded.messages, nbytes = excluded.nbytes, last_used = excluded.last_used,"
                " ended = NULL, ended_at = NULL",
                (key, done.kind.value, done.turns, ids_to_bytes(done.token_ids), messages, nbytes, now),
            )
            conn.execute("UPDATE totals SET sessions = sessions + 1, nbytes = nbytes + ?", (nbytes,))
            self._enforce_limits(conn, key, now)

    def _delete(self, conn: sqlite3.Connection, key: str) -> bool:
        now = self._clock()
        with _write(conn):
            row = _read(conn, key)
            existed = row is not None and row["kind"] is not None and not self._expired(row, now)
            self._drop(conn, key, None, now)
            self._end(conn, key, reason_deleted(), now)
            conn.execute("UPDATE sessions SET epoch = epoch + 1 WHERE key = ?", (key,))
            self._prune(conn, now)
            return existed

    def _renew_in(self, conn: sqlite3.Connection, key: str, token: str) -> bool:
        until = self._clock() + self.config.lease_s
        with _write(conn, durable=False):
            cur = conn.execute("UPDATE sessions SET lease_until = ? WHERE key = ? AND lease = ?", (until, key, token))
            return cur.rowcount == 1

    def _release_in(self, conn: sqlite3.Connection, key: str, token: str) -> None:
        with _write(conn, durable=False):
            conn.execute(
                "UPDATE sessions SET lease = NULL, lease_holder = NULL WHERE key = ? AND lease = ?", (key, token)
            )

    # -- book-keeping inside a transaction ---------------------------------------------------------------

    def _expired(self, row: sqlite3.Row, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        return row["kind"] is not None and row["last_used"] <= now - self.config.ttl_s

    def _drop(self, conn: sqlite3.Connection, key: str, reason: str | None, now: float) -> None:
        """Forget the history held for `key` (if any), keeping its row's epoch and lease; `reason` ends it."""
        held = conn.execute("SELECT nbytes FROM sessions WHERE key = ? AND kind IS NOT NULL", (key,)).fetchone()
        if held is None:
            return
        conn.execute(
            "UPDATE sessions SET kind = NULL, ids = NULL, messages = NULL, last_used = NULL, nbytes = 0, turns = 0"
            " WHERE key = ?",
            (key,),
        )
        conn.execute("UPDATE totals SET sessions = sessions - 1, nbytes = nbytes - ?", (held[0],))
        if reason is not None:
            self._end(conn, key, reason, now)

    def _end(self, conn: sqlite3.Connection, key: str, reason: str, now: float) -> None:
        conn.execute(
            "INSERT INTO sessions (key, ended, ended_at) VALUES (?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET ended = excluded.ended, ended_at = excluded.ended_at",
            (key, reason, now),
        )

    def _expire(self, conn: sqlite3.Connection, now: float) -> None:
        stale = conn.execute(
            "SELECT key FROM sessions WHERE kind IS NOT NULL AND last_used <= ?", (now - self.config.ttl_s,)
        ).fetchall()
        for (key,) in stale:
            self._drop(conn, key, reason_ttl(self.config.ttl_s), now)
        if stale:
            self._prune(conn, now)

    def _enforce_limits(self, conn: sqlite3.Connection, keep: str, now: float) -> None:
        """Evict least recently used histories past max_sessions or the byte cap; `keep` only if alone."""
        cfg = self.config
        evicted = False
        while True:
            count, nbytes = conn.execute("SELECT sessions, nbytes FROM totals").fetchone()
            over_count = count > cfg.max_sessions
            if not over_count and nbytes <= cfg.max_bytes:
                break
            oldest = conn.execute(
                "SELECT key FROM sessions WHERE kind IS NOT NULL ORDER BY last_used, key = ? LIMIT 1", (keep,)
            ).fetchone()
            self._drop(
                conn, oldest[0], reason_count(cfg.max_sessions) if over_count else reason_bytes(cfg.max_bytes), now
            )
            evicted = True
        if evicted:
            self._prune(conn, now)

    def _prune(self, conn: sqlite3.Connection, now: float) -> None:
        """Keep the newest MAX_TOMBSTONES rows without a history (rows with a live lease stay)."""
        conn.execute(
            "DELETE FROM sessions WHERE key IN (SELECT key FROM sessions WHERE kind IS NULL"
            " AND (lease IS NULL OR lease_until <= ?) ORDER BY ended_at DESC LIMIT -1 OFFSET ?)",
            (now, MAX_TOMBSTONES),
        )

    def _history(self, row: sqlite3.Row) -> History:
        kind = HistoryInput(row["kind"])
        messages = tuple((r, c) for r, c in json.loads(row["messages"])) if row["messages"] else ()
        used = row["last_used"]
        return History(kind, ids_from_bytes(row["ids"]), messages, row["turns"], used, used)


def _read(conn: sqlite3.Connection, key: str) -> sqlite3.Row | None:
    row: sqlite3.Row | None = conn.execute(f"SELECT {_ROW} FROM sessions WHERE key = ?", (key,)).fetchone()
    return row


def _schema(conn: sqlite3.Connection) -> None:
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)


@contextlib.contextmanager
def _write(conn: sqlite3.Connection, *, durable: bool = True) -> Iterator[None]:
    """One write transaction, taken at once (BEGIN IMMEDIATE) so that two processes never both read then write.

    `durable`: synced to disk before it returns (synchronous=FULL). Leases are not: a lease lost with the
    machine only frees its session early, and the next durable commit syncs the WAL frames before it too.
    """
    conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _explain(exc: sqlite3.Error, busy_timeout_s: float) -> str:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return f"{text} (another process holds its write lock longer than {busy_timeout_s:g} s)"
    if "full" in text:
        return f"{text} (no space left for the file)"
    if isinstance(exc, sqlite3.DatabaseError) and (
        "malformed" in text or "not a database" in text or "integrity" in text
    ):
        return f"{text} (the file is damaged: restore it from a backup or move it aside to start empty)"
    return text
