"""What a history store raises; the servicer maps each to a status code (api/prompts.py, api/errors.py)."""

from __future__ import annotations


class NoHistory(LookupError):
    """No history is held for the session; `reason` says why when the store remembers it."""

    def __init__(self, key: str, reason: str | None) -> None:
        super().__init__(f"no history for session {key!r}" + (f": {reason}" if reason else ""))
        self.key = key
        self.reason = reason


class HistoryBusy(RuntimeError):
    """Another call is continuing the session right now."""

    def __init__(self, key: str, request_id: str) -> None:
        super().__init__(f"session {key!r} is being continued by request {request_id!r}")
        self.key = key
        self.request_id = request_id


class LeaseLost(RuntimeError):
    """A continuing call's lease expired and another call took the session: its turn was not written."""

    def __init__(self, key: str) -> None:
        super().__init__(f"session {key!r}: the call's lease expired and another call continued the session")
        self.key = key


class StoreUnavailable(RuntimeError):
    """The history store did not answer, or answered with an error; `store` names it (no secrets)."""

    def __init__(self, store: str, reason: str) -> None:
        super().__init__(f"the session history store {store} is unavailable: {reason}")
        self.store = store
        self.reason = reason
