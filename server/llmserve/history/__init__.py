"""Session histories: what a conversation has said so far, so that a call can send only its new turn.

Every call with a session id that finishes normally leaves its session's history in the store: the call's
whole input (chat messages, or token ids) and its answer. A call in append mode (`continue_session`) reads it
and appends its own input: chat as the held messages, the answer as an assistant message, then the new
messages; text and token ids as the held token ids followed by the new ones.

The history lives beside the servicer, not in the engine. Chat messages are a service concept (the engine
only ever sees token ids), and the engine's SessionStore is a cache whose blocks the pool takes back under
pressure: a history must outlive that (and, in a durable store, the process), so it is kept apart and the
next turn recomputes what was evicted. Both are keyed by the same session key. A history ends only by the
TTL, `max_sessions`, the byte cap (least recently used first), deletion, or reaching the per-session token
cap; the store remembers why for a while, so that a NOT_FOUND can say so.

`--history-store` picks the store: `memory` (this process only), `sqlite:PATH` (survives restarts; shared by
the processes of one machine), `redis://HOST:PORT/DB` (shared by replicas). By role: store.py holds the
contract, records.py what it holds (History, Turn), config.py, errors.py, reasons.py (the NOT_FOUND reasons) and
codec.py (the durable stores' token encoding); how a continuing call's prompt is composed is api/prompts.py's.
"""

from __future__ import annotations

from llmserve.history.config import HistoryConfig
from llmserve.history.errors import HistoryBusy, LeaseLost, NoHistory, StoreUnavailable
from llmserve.history.memory import MemoryHistoryStore
from llmserve.history.records import NORMAL_FINISH, History, HistoryInput, Message, Turn
from llmserve.history.store import HistoryStore

__all__ = [
    "NORMAL_FINISH",
    "History",
    "HistoryBusy",
    "HistoryConfig",
    "HistoryInput",
    "HistoryStore",
    "LeaseLost",
    "MemoryHistoryStore",
    "Message",
    "NoHistory",
    "StoreUnavailable",
    "Turn",
    "check_store_spec",
    "open_store",
]


def check_store_spec(text: str) -> str:
    """`text` if it names a store (memory, sqlite:PATH, redis://..., rediss://...); raises ValueError."""
    spec = text.strip()
    if spec == "memory":
        return spec
    if spec.startswith("sqlite:"):
        if not spec[len("sqlite:") :]:
            raise ValueError("sqlite: needs a file path, e.g. sqlite:/var/lib/llmserve/sessions.db")
        return spec
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return spec
    raise ValueError(f"must be memory, sqlite:PATH or redis://HOST:PORT/DB, got {text!r}")


def open_store(config: HistoryConfig) -> HistoryStore:
    """The store `config.store` names (None: memory), not yet connected (the server calls `connect()` at start)."""
    spec = check_store_spec(config.store or "memory")
    if spec == "memory":
        return MemoryHistoryStore(config)
    if spec.startswith("sqlite:"):
        from llmserve.history.sqlite_store import SqliteHistoryStore

        return SqliteHistoryStore(config, spec[len("sqlite:") :])
    from llmserve.history.redis_store import RedisHistoryStore

    return RedisHistoryStore(config, spec)
