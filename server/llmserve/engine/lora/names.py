"""Adapter names and the rank bound, torch-free: the flags, the gRPC edge and the engine check them the same way."""

from __future__ import annotations

import re

MAX_LORA_RANK = 256  # the largest --max-lora-rank (vLLM serves up to 512; 256 is far past what fine-tunes use)
MAX_ADAPTER_NAME_LENGTH = 128
# What a name may hold: letters, digits and . _ - / : @ (a Hugging Face repo id, a version tag), so that it is safe
# in a metric label, a log line and the gateways' comma-separated lists (no commas, no spaces).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:@]*")


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None when it can."""
    if len(name) > MAX_ADAPTER_NAME_LENGTH:
        return f"is {len(name)} characters, the limit is {MAX_ADAPTER_NAME_LENGTH}"
    if _NAME.fullmatch(name) is None:
        return "must start with a letter or digit and hold only letters, digits and . _ - / : @"
    return None


def check_adapter_name(name: str) -> None:
    """Raises ValueError when `name` cannot name an adapter."""
    problem = adapter_name_problem(name)
    if problem is not None:
        raise ValueError(f"adapter name {name!r} {problem}")
