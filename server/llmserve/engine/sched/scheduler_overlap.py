"""The scheduler's part in overlap (--async-scheduling, engine/core_overlap.py): the books of a step that is
launched before the previous one's tokens are known.

A step is accounted twice. `launched` right after the step is handed to the runner: its tokens count as computed
and each sampling entry leaves one token pending (`Sequence.num_pending`), so that the next schedule plans that
sequence's next position with a placeholder (plan.PENDING) while the step runs. `landed` once its results are in:
the blocks it filled are hashed and registered for prefix caching (only now: the tokens are known, and the KV is
written), and the copy sources it held are let go. A step whose forward failed is `abandon`ed instead: nothing it
wrote is registered. Steps run in launch order on one device stream or worker, so a block freed while a step is in
flight is only written again by a later step.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmserve.engine.sched.block_pool import BlockPool
from llmserve.engine.sched.plan import SeqStep, StepPlan
from llmserve.engine.sched.sequence import Sequence


class OverlapBooks:
    """Scheduler methods for steps launched ahead of their predecessor's tokens (see the module docstring)."""

    pool: BlockPool
    enable_prefix_caching: bool

    def _register_full_blocks(self, seq: Sequence, computed_before: int, upto: int | None = None) -> None:
        raise NotImplementedError

    def launched(self, plan: StepPlan) -> None:
        """The plan's step is on its way: count its tokens computed and one token pending per sampling entry."""
        for step in plan.seqs:
            if step.drafts:
                raise ValueError("a step with drafts is not launched ahead (overlap is off for speculative steps)")
            seq = step.seq
            seq.num_computed += len(step.token_ids)
            if step.sample is not None:
                seq.num_pending += 1

    def landed(self, plan: StepPlan, live: Iterable[SeqStep]) -> None:
        """The plan's step is done and its tokens appended: register the blocks that the `live` entries (those
        still running, not preempted since) filled; let the copy sources go."""
        if self.enable_prefix_caching:
            bs = self.pool.block_size
            for step in live:
                if step.end // bs > step.start // bs:
                    self._register_full_blocks(step.seq, step.start, step.end)
        self.pool.release(src for src, _ in plan.copies)
