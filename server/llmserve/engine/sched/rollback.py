"""The KV books after a verification step: what a sequence keeps of the positions it computed, and what it frees.

A sequence with k drafts computes k + 1 positions in a step: its last token (sampled the step before, not yet
computed) at position `start`, then the drafts at start + 1 .. start + k. Its block table was grown for all of them
(blocks_for(start + 1 + k) blocks). Once `accepted` drafts are accepted, the KV of positions start .. start +
accepted is its own (the last token and the accepted drafts); the KV of the rejected drafts is not: the token the
sampler picked at the first rejected position (the correction) is the sequence's new last token, uncomputed like
any sampled token, and its KV is written over that position's slot by the next step.

So the books settle as a step without drafts would have left them, had it computed the accepted tokens one by one:
- `num_computed` = start + 1 + accepted (never the drafts' count): the prefix cache registers a block only once
  num_computed covers it, so no block that holds a rejected draft's KV ever gets a hash, and a session retains
  `token_ids[:num_computed]`, exactly the tokens that were sent;
- the table keeps blocks_for(num_computed) blocks (the invariant of a running sequence after any step) and releases
  the rest. Those were allocated fresh for this step by the scheduler's grow (every block past the one holding
  position `start` is), so each has one reference and no hash, and goes straight back to the free list;
- in the last block kept, the slots past num_computed hold rejected KV: stale, never read (attention reads a
  sequence's first `context` positions only) and overwritten as the sequence goes on.

`settle` is that rule as a pure function over the books; tests/engine/spec/test_rollback.py drives it with the real
BlockPool in a hypothesis state machine that checks the pool's ref counts and that every position a sequence
counts as computed, and every block the prefix cache holds, has exactly the KV of its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.engine.types.kv_cache import blocks_for


@dataclass(slots=True, frozen=True)
class Settled:
    """A sequence's books after its verification step: its computed count, how many blocks of its table it keeps,
    the blocks to release (the table's tail past them) and the positions whose slots hold stale KV."""

    num_computed: int
    keep: int
    freed: list[int]
    stale: range


def settle(block_table: Sequence[int], start: int, num_drafts: int, accepted: int, block_size: int) -> Settled:
    """The books of a sequence that computed positions [start, start + 1 + num_drafts) (its last token, then its
    drafts) and had `accepted` of the drafts accepted. Raises ValueError for an accepted count out of range or a
    table too short for the positions computed."""
    if not 0 <= accepted <= num_drafts:
        raise ValueError(f"accepted must be in [0, {num_drafts}], got {accepted}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    end = start + 1 + num_drafts
    if len(block_table) < blocks_for(end, block_size):
        raise ValueError(f"a table of {len(block_table)} blocks cannot hold positions up to {end}")
    num_computed = start + 1 + accepted
    keep = blocks_for(num_computed, block_size)
    return Settled(num_computed, keep, list(block_table[keep:]), range(num_computed, min(end, keep * block_size)))
