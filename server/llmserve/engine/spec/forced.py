"""Drafts from a constrained request's grammar, and the per-position masks that verifying drafts needs.

Where the grammar allows only one continuation (the keys and punctuation of a JSON schema, a choice's rest once it
is unambiguous), llguidance names the tokens that spell it (`compute_ff_tokens`): free drafts. The model may
still prefer another spelling of the same bytes, so they are verified like any other draft; they are accepted
whenever the model agrees (the phase-1 probe spec_proposers.py measured how often).

Past the forced tokens a prompt-lookup draft may go on; `grammar_drafts` keeps only as much of it as the grammar
allows (`validate_tokens` after the forced ones), so that no position is spent on a token the mask would refuse.

`draft_bitmasks` fills, in one batched call of the library, the allowed tokens at every position of each
constrained sequence's drafts: position j's mask is the grammar's state after the first j drafts (the library
advances a copy of the state and rolls it back). A draft the grammar refuses ends its sequence's masks there: no
later position can be accepted.

Every function leaves the matcher in the state it was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance
import torch

_executor: llguidance.LLExecutor | None = None


def _parallel() -> llguidance.LLExecutor:
    """This module's executor for batched mask fills, built on first use."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor


def forced_tokens(matcher: Any, k: int) -> list[int]:
    """Up to `k` tokens the grammar forces from the matcher's state ([] when it allows a choice, or is done)."""
    if k <= 0 or matcher.is_stopped() or matcher.is_error():
        return []
    return list(matcher.compute_ff_tokens()[:k])


def grammar_drafts(matcher: Any, k: int, guess: Sequence[int] = ()) -> tuple[list[int], int]:
    """The forced tokens, then as much of `guess` (drafts from another proposer for the text after them) as the
    grammar allows, at most `k` in all. Returns (drafts, how many of them are forced)."""
    forced = forced_tokens(matcher, k)
    room = k - len(forced)
    if room <= 0 or not guess:
        return forced, len(forced)
    if forced and not matcher.consume_tokens(forced):
        return forced, len(forced)  # cannot happen for the library's own forced tokens: keep them, add nothing
    try:
        valid = matcher.validate_tokens(list(guess[:room]))
    finally:
        if forced:
            matcher.rollback(len(forced))
    return forced + list(guess[:valid]), len(forced)


def draft_bitmasks(rows: Sequence[tuple[Any, Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """The allowed tokens at every position of each (matcher, drafts) in `rows`: an int32 CPU bitmask
    [sum(len(drafts) + 1), ceil(vocab / 32)], sequence by sequence, position 0 (the state as it is) first.

    Positions after a draft the grammar refuses allow nothing (all bits clear): they are never accepted."""
    total = sum(len(drafts) + 1 for _, drafts in rows)
    bitmask = torch.zeros((total, (vocab_size + 31) // 32), dtype=torch.int32)
    work = []
    at = 0
    for matcher, drafts in rows:
        work.append((matcher, at, list(drafts)))
        at += len(drafts) + 1
    # Imported here: llguidance.torch compiles a kernel with torch.compile at import (seconds), which the engine's
    # own path (the drafter and the sampler) never needs.
    import llguidance.torch

    llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(_parallel(), work, bitmask)
    return bitmask
