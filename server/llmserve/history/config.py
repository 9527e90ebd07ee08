"""The history store's limits and where it lives (`--history-store`, `--session-ttl`, ... in flags.py)."""

from __future__ import annotations

from dataclasses import dataclass

# How many ended histories remember why they ended (for the NOT_FOUND message); Redis keeps them a day instead.
MAX_TOMBSTONES = 4096


@dataclass(slots=True, frozen=True)
class HistoryConfig:
    """Limits of the history store and where it lives. `max_tokens` None: the model's context length (the
    servicer resolves it when it attaches the engine; api/prompts.py applies it).

    `store`: "memory", "sqlite:PATH" or "redis://HOST:PORT/DB"; None: memory for a server built in-process,
    `sqlite:<cache dir>/sessions.sqlite3` for `python -m llmserve` (config.from_args fills it in).
    `optional`: a store unreachable at start leaves the server serving stateless calls (calls with a session id
    fail UNAVAILABLE until it answers).
    `lease_s`: how long a continuing call's lease outlives its holder's last renewal (shared stores).
    """

    ttl_s: float = 600.0
    max_sessions: int = 4096
    max_bytes: int = 256 << 20
    max_tokens: int | None = None
    store: str | None = None
    optional: bool = False
    lease_s: float = 10.0
