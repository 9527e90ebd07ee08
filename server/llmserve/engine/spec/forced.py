"""Drafts from a constrained request's grammar.

Where the grammar allows only one continuation (the keys and punctuation of a JSON schema, a choice's rest once it
is unambiguous), llguidance names the tokens that spell it (`compute_ff_tokens`): free drafts. The model may
still prefer another spelling of the same bytes, so they are verified like any other draft; they are accepted
whenever the model agrees (the phase-1 probe spec_proposers.py measured how often).

Past the forced tokens a prompt-lookup draft may go on; `grammar_drafts` keeps only as much of it as the grammar
allows (`validate_tokens` after the forced ones), so that no position is spent on a token the mask would refuse.

Verifying them masks each position with the grammar advanced over the drafts before it (verify.grammar_positions).

Every function leaves the matcher in the state it was given.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance


def forced_tokens(matcher: llguidance.LLMatcher, k: int) -> list[int]:
    """Up to `k` tokens the grammar forces from the matcher's state ([] when it allows a choice, or is done)."""
    if k <= 0 or matcher.is_stopped() or matcher.is_error():
        return []
    return list(matcher.compute_ff_tokens()[:k])


def grammar_drafts(matcher: llguidance.LLMatcher, k: int, guess: Sequence[int] = ()) -> tuple[list[int], int]:
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
