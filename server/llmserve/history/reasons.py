"""Why a history ended, as a NOT_FOUND quotes it to a caller who tries to continue it: each names the flag."""

from __future__ import annotations


def reason_ttl(ttl_s: float) -> str:
    return f"it expired after {ttl_s:g} s idle (the server's --session-ttl)"


def reason_deleted() -> str:
    return "it was deleted (DeleteSession)"


def reason_tokens(max_tokens: int) -> str:
    return f"it ended when it reached the server's --max-session-tokens ({max_tokens})"


def reason_count(max_sessions: int) -> str:
    return f"it was evicted: the server holds at most {max_sessions} (--max-sessions)"


def reason_bytes(max_bytes: int) -> str:
    return f"it was evicted: histories are capped at {max_bytes / (1 << 20):g} MiB (--session-history-mib)"
