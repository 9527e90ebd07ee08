"""The errors the engine raises to its callers, each with the status a gRPC edge maps it to (api/errors.py).

Nothing here imports torch, nor any other engine module: the edge, the config and the engine all import these.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that can never be served as asked; `field` names the offending request field."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


class EngineDead(RuntimeError):
    """The core cannot serve: it hit an error it could not recover from, or it has stopped."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its limit; the caller should retry later."""
