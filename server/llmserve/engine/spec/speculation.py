"""Speculative decoding as the engine core holds it: one object, `None` when `--speculative off` (as the LoRA and KV
tier services are), with everything of speculation behind it.

Each step the core's plain runner (core/steps.py) asks it three things, and nothing else of spec/:
- `drafts`, before the schedule: which decoding sequences verify which guesses this step (the drafter: the proposer,
  the load rule over the step-cost table and each request's measured acceptance; drafter.py), fitted in what the
  token budget leaves after every running sequence's own tokens and the prompts waiting to be admitted;
- `verify`, once the plan is made: a plan whose scheduler gave some sequences drafts gets each of their positions'
  sample rows, and each sampled stream's state is noted (verify.py); None for a plan without drafts, which then
  samples through the sampler alone;
- after the forward, per verifying sequence: `settle` (the books of its drafts' KV: the accepted ones it kept are
  computed, the rest dropped; rollback.py's rule, kept by Scheduler.settle_drafts) and `observe` (its acceptance).

At start-up `calibrate` measures the step-cost table on the core's own step (calibrate.py), unless the config gave
one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmserve.engine.config import EngineConfig
from llmserve.engine.sched.plan import SeqStep, StepPlan
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.spec.calibrate import CalibrationTarget, calibrate, load_table
from llmserve.engine.spec.drafter import Drafter
from llmserve.engine.spec.verify import Verification, grammar_positions, position_rows
from llmserve.engine.types.stats import SpecStats

if TYPE_CHECKING:
    from llmserve.engine.sample.streams import StreamMark
    from llmserve.engine.sched.scheduler import Scheduler
    from llmserve.engine.sched.sequence import SampleRow

log = logging.getLogger(__name__)


class Speculation:
    """The drafter of one engine core and what a step asks of speculation (see the module docstring)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int) -> Speculation | None:
        """The config's speculative decoding (None when off); its cost table is measured by `calibrate` unless the
        config names one. Raises RuntimeError when the method's library is not installed."""
        if config.speculative == "off":
            return None
        if config.speculative == "suffix":
            from llmserve.engine.spec.suffix import available

            if not available():
                raise RuntimeError(
                    "--speculative suffix needs arctic-inference's suffix trees, which are not installed here "
                    "(`make install` builds them); or choose --speculative ngram|off"
                )
        cost = None if config.speculative_cost_table is None else load_table(config.speculative_cost_table)
        return cls(Drafter(config.speculative, config.speculative_max_k, max_model_len, cost))

    def calibrate(self, target: CalibrationTarget, max_num_seqs: int, max_num_batched_tokens: int) -> bool:
        """Measure the load rule's step-cost table on `target`, once, unless it is known (a few seconds on a CPU; on
        the step thread, before it serves). False when the measurement failed: never a reason not to serve, the
        caller serves without speculation."""
        drafter = self.drafter
        if drafter.policy is not None:
            return True
        start = time.monotonic()
        try:
            drafter.set_cost(calibrate(target, drafter, max_num_seqs, max_num_batched_tokens))
        except Exception:
            log.exception("speculative decoding: measuring the step cost failed; speculation is off")
            return False
        took = time.monotonic() - start
        log.info("speculative decoding: step-cost table measured in %.1f s: %s", took, drafter.cost)
        return True

    def drafts(self, scheduler: Scheduler, max_num_seqs: int, max_num_batched_tokens: int) -> dict[int, list[int]]:
        """By seq_no, the drafts the running sequences verify this step: within what the token budget leaves after
        every running sequence's own tokens and, while there is room for more sequences, the prompts waiting to be
        admitted."""
        running = scheduler.running
        budget = max_num_batched_tokens - sum(seq.num_uncomputed for seq in running)
        if len(running) < max_num_seqs:
            budget -= scheduler.waiting_tokens(max(budget, 0))
        return self.drafter.drafts(running, budget)

    def verify(self, plan: StepPlan, mark_stream: Callable[[SampleRow], StreamMark]) -> Verification | None:
        """For a plan with drafts: each verifying entry's position rows (`SeqStep.position_rows`: penalties,
        blocked ids and the grammar per position, one random stream), and its sampled stream noted before the
        sampler draws (`mark_stream`: the backend's); None for a plan without drafts."""
        verifying = [entry for entry in plan.sampling if entry.drafts]
        if not verifying:
            return None
        verification = Verification()
        for entry in verifying:
            row, seq = entry.sample, entry.seq
            assert row is not None  # plan.sampling's
            blocked = seq.request.stopping.min_new_tokens - seq.num_generated
            positions = position_rows(row, entry.drafts, blocked_positions=blocked)
            if row.constraint is not None:
                states = grammar_positions(row.constraint, entry.drafts)
                positions = [dataclasses.replace(p, constraint=c) for p, c in zip(positions, states, strict=True)]
            entry.position_rows = positions
            if not row.params.greedy:
                verification.mark(row, mark_stream(row))
        return verification

    def step_verified(self) -> None:
        """A step verified drafts (counted for the metrics)."""
        self.drafter.step_verified()

    def settle(self, scheduler: Scheduler, entry: SeqStep) -> None:
        """After the sequence's emitted tokens were appended: the books of its drafts' KV (nothing for a sequence
        that has finished: its blocks are gone already)."""
        seq = entry.seq
        if seq.status is not SeqStatus.FINISHED:
            kept = max(0, min(len(entry.drafts), len(seq.token_ids) - entry.start - 2))
            scheduler.settle_drafts(entry, kept)

    def observe(self, entry: SeqStep, accepted: int) -> None:
        """The sequence verified its drafts: `accepted` of them were accepted; what it kept (fewer after a stop)."""
        kept = len(entry.seq.token_ids) - entry.start - 1
        self.drafter.observe(entry.seq.seq_no, len(entry.drafts), accepted, kept)

    def release(self, seq: Sequence) -> None:
        """A sequence ended: its state is dropped, its answer stays in its identity's suffix tree (Drafter.release)."""
        self.drafter.release(seq)

    def stats(self) -> SpecStats:
        """The counters for the metrics (any thread)."""
        return self.drafter.snapshot()
