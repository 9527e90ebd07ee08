"""The scheduler's part in speculative decoding (engine/spec): room for drafts, and the books after verifying them.

`Scheduler.schedule(drafts)` gives a decoding sequence its drafts as extra positions of its step when they fit in
the token budget and in blocks that are free now (a guess never preempts, evicts a session or a cached prefix);
`settle_drafts` keeps the books once the sampler has accepted some of them (spec/rollback.py's rule: the KV of
rejected drafts is dropped, their blocks freed, never hashed). A mixin of `Scheduler`, whose books it reads.
"""

from __future__ import annotations

from llmserve.engine.sched.block_pool import BlockPool
from llmserve.engine.sched.plan import SeqStep
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.spec.rollback import settle


class DraftBooks:
    """Scheduler methods for drafts (see the module docstring)."""

    pool: BlockPool
    enable_prefix_caching: bool
    _waiting: list[tuple[int, int, Sequence]]

    def _register_full_blocks(self, seq: Sequence, computed_before: int) -> None:
        raise NotImplementedError

    def settle_drafts(self, step: SeqStep, kept: int) -> None:
        """After `update`: `kept` of the step's drafts were accepted and appended to the sequence's tokens. Counts
        them computed, registers the blocks they filled and frees the blocks past what the sequence now needs."""
        seq = step.seq
        bs = self.pool.block_size
        settled = settle(step.block_table, step.start, len(step.drafts), kept, bs)
        before = seq.num_computed
        seq.num_computed = settled.num_computed
        if self.enable_prefix_caching and seq.num_computed // bs > before // bs:
            self._register_full_blocks(seq, before)
        if settled.freed:
            self.pool.release(settled.freed)
            # A new list, not one cut in place: a backend's input batch keeps each row's table by identity and
            # rewrites it only when the list is another (a table cut in place and grown again would look unchanged).
            seq.block_table = seq.block_table[: settled.keep]

    def waiting_tokens(self, limit: int) -> int:
        """The prompt tokens that waiting sequences would compute, counted up to `limit` (what admission may take
        of the next step's budget)."""
        total = 0
        for _, _, seq in self._waiting:
            if seq.status is SeqStatus.WAITING:
                total += seq.num_uncomputed
                if total >= limit:
                    return limit
        return total

    def _room_for_drafts(self, seq: Sequence, k: int, budget: int) -> bool:
        """Whether a decoding seq can verify k drafts: within `budget` and blocks free now (no eviction)."""
        if seq.num_uncomputed != 1 or 1 + k > budget:
            return False
        need = self.pool.blocks_for(seq.num_computed + 1 + k) - len(seq.block_table)
        return need <= self.pool.num_free - self.pool.num_cached
