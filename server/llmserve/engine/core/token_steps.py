"""The core's token steps: the sampled tokens of a step appended to their requests one by one through the stop
checks, and speculative decoding's part of a step (engine/spec): the drafts asked for before the schedule, a
verifying sequence's emitted tokens and books after the forward, and the step-cost measurement at start-up.

A mixin of `EngineCore` (engine/core.py), which owns the state it reads; on the step thread only.
"""

from __future__ import annotations

import logging
import time

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.client import Add
from llmserve.engine.frontend.outputs import EngineOutput, FinishReason, RequestStart
from llmserve.engine.frontend.request import GenerationRequest
from llmserve.engine.sample.constraints import ConstraintState
from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sched.plan import SeqStep
from llmserve.engine.sched.scheduler import Scheduler
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.spec.drafter import Drafter
from llmserve.engine.spec.verify import Verified

log = logging.getLogger(__name__)


class TokenSteps:
    """What EngineCore's step does with sampled tokens and drafts (see the module docstring)."""

    config: EngineConfig
    scheduler: Scheduler
    drafter: Drafter | None
    max_model_len: int
    _collected: list[EngineOutput]

    def _admit(self, command: Add, constraint: ConstraintState | None) -> None:
        raise NotImplementedError

    def _finish(
        self, seq: Sequence, reason: FinishReason, *, output: EngineOutput | None = None, error: str | None = None
    ) -> None:
        raise NotImplementedError

    def calibrate_speculation(self) -> None:
        """Measure the load rule's step-cost table on this core, once, unless it was given one (a few seconds on
        a CPU; on the step thread, before it serves)."""
        if self.drafter is not None and self.drafter.policy is None:
            from llmserve.engine.spec.calibrate import calibrate

            start = time.monotonic()
            try:
                self.drafter.set_cost(calibrate(self))  # type: ignore[arg-type]  # self is an EngineCore
            except Exception:  # never a reason not to serve: serve without speculation
                log.exception("speculative decoding: measuring the step cost failed; speculation is off")
                self.drafter = None
                return
            took = time.monotonic() - start
            log.info("speculative decoding: step-cost table measured in %.1f s: %s", took, self.drafter.cost)

    def add_now(self, request: GenerationRequest, handle: int) -> None:
        """Start an unconstrained request at once, past the inbox (the step thread only: the calibration's own
        requests, which must not drain callers' commands; negative handles, which no client uses)."""
        self._admit(Add(handle, request, time.monotonic()), None)

    def cancel_now(self, handle: int) -> None:
        """End a request started by add_now at once (the step thread only); its outputs are the caller's to drop."""
        seq = self.scheduler.live.get(handle)
        if seq is not None:
            self._finish(seq, FinishReason.CANCELLED)

    def _drafts(self) -> dict[int, list[int]] | None:
        """The drafts the running sequences verify this step (none without speculation): what the token budget
        leaves after every running sequence's own tokens and the prompts waiting to be admitted."""
        if self.drafter is None:
            return None
        running = self.scheduler.running
        budget = self.config.max_num_batched_tokens - sum(seq.num_uncomputed for seq in running)
        if len(running) < self.config.max_num_seqs:
            budget -= self.scheduler.waiting_tokens(max(budget, 0))
        return self.drafter.drafts(running, budget)

    def _verified(self, entry: SeqStep, result: Sampled | RowFailed | Verified, now: float) -> None:
        """A sequence's verification step: its emitted tokens one by one through `_append`'s checks, up to the first
        that ends it; then its books (the accepted drafts it kept are computed, the rest of the KV dropped)."""
        seq = entry.seq
        if not isinstance(result, Verified):
            self._append(seq, result, now, settle=entry)
            return
        assert self.drafter is not None
        self._append(seq, result.samples, now, settle=entry)
        kept = len(seq.token_ids) - entry.start - 1  # tokens appended (fewer after a stop)
        self.drafter.observe(seq.seq_no, len(entry.drafts), result.accepted, kept)

    def _append(
        self,
        seq: Sequence,
        result: Sampled | RowFailed | list[Sampled],
        now: float,
        *,
        settle: SeqStep | None = None,
    ) -> None:
        """Hand sampled tokens to their request, one by one, up to the first that ends it (`settle`: the step
        verified drafts, whose books are kept before the request can finish); a failed row is that request's
        alone."""
        if isinstance(result, RowFailed):
            self._settle(settle, seq)
            self._finish(seq, FinishReason.ERROR, error=result.error)
            return
        samples = result if isinstance(result, list) else [result]
        output = EngineOutput(seq.seq_no, seq.request_id, [], None)
        reason: FinishReason | None = None
        for sampled in samples:
            reason = self._take(seq, sampled, output, now)
            if reason is not None:
                break
        self._settle(settle, seq)
        if reason is FinishReason.ERROR:
            return
        if reason is None:
            self._collected.append(output)
        else:
            self._finish(seq, reason, output=output)

    def _settle(self, entry: SeqStep | None, seq: Sequence) -> None:
        if entry is not None and seq.status is not SeqStatus.FINISHED:  # finished: its blocks are gone already
            self.scheduler.settle_drafts(entry, max(0, min(len(entry.drafts), len(seq.token_ids) - entry.start - 2)))

    def _take(self, seq: Sequence, result: Sampled, output: EngineOutput, now: float) -> FinishReason | None:
        """Append one token to the sequence and its output; the reason it ends the request, if it does (ERROR: it
        has been finished already, as the constraint refused the token)."""
        token_id = result.token_id
        seq.token_ids.append(token_id)
        output.token_ids.append(token_id)
        if result.logprob is not None:
            if output.logprobs is None:
                output.logprobs = []
            output.logprobs.append(result.logprob)
        if seq.first_token is None:
            seq.first_token = now
            started = seq.first_scheduled if seq.first_scheduled is not None else now
            output.start = RequestStart(
                seq.num_prompt, seq.num_cached_prompt, seq.seed, seq.arrival, started - seq.arrival, now - seq.arrival
            )
        constraint = seq.constraint
        if constraint is not None and not constraint.accept(token_id):  # the mask let through what it forbids
            error = f"the constraint rejected token {token_id}: {constraint.error}"
            self._finish(seq, FinishReason.ERROR, error=error)
            return FinishReason.ERROR
        if token_id in seq.stop_ids:
            return FinishReason.STOP_TOKEN
        if token_id in seq.eos_ids:
            return FinishReason.EOS
        if constraint is not None and constraint.done:  # complete: only the end could follow
            return FinishReason.CONSTRAINT
        if seq.num_generated >= seq.request.stopping.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def build_drafter(config: EngineConfig, max_model_len: int) -> Drafter | None:
    """The config's speculative decoding (None when off); its cost table is measured in warm_up."""
    if config.speculative == "off":
        return None
    if config.speculative == "suffix":
        from llmserve.engine.spec.suffix import available

        if not available():
            raise RuntimeError(
                "--speculative suffix needs arctic-inference's suffix trees, which are not installed here "
                "(`make install` builds them); or choose --speculative ngram|off"
            )
    cost = None
    if config.speculative_cost_table is not None:
        from llmserve.engine.spec.calibrate import load_table

        cost = load_table(config.speculative_cost_table)
    return Drafter(config.speculative, config.speculative_max_k, max_model_len, cost)
