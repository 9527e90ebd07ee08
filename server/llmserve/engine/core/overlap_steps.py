"""The core's overlapped step (--async-scheduling): plan and launch step N+1 before taking step N's tokens.

One `overlap_step` call: expire deadlines; schedule step N+1, which gives each sequence still decoding in step N
its next position with a placeholder (the token N samples: Sequence.num_pending, plan.PENDING); launch it on the
runner (overlap.py), which starts it once step N is done; then take step N's results, wait for them if they are
not in, and hand its tokens out through the same checks as a plain step (core_tokens). So the step thread's
schedule, books and outputs of one step run while the forward of the next one does.

What a plain step guarantees holds:
- tokens are handed out in order, one step's after the previous one's;
- a command drained between two calls (an abort, a stop string's abort) acts at once: the request's final output
  is collected then, and the token a step already in flight samples for it is dropped when that step lands;
- a sequence that ended or was preempted after a step was launched gets nothing from it; its KV past what had
  landed is never kept for a session or registered for prefix caching, and a preempted sampled sequence's random
  stream is rewound to the draws of the tokens it kept (so that it samples the dropped position again as it did);
- a token made unwanted by a later stop (EOS, a stop token or string, max_new_tokens) is dropped: no step is
  planned past a length the tokens in flight reach, and an EOS or stop in step N leaves step N+1's row for that
  sequence computed but unused.

A step plans ahead only where the next token's inputs do not depend on the token in flight beyond its id: a
sequence in flight with a constraint (its grammar must take the token before the next mask), or with repetition,
frequency or presence penalties (which read the generated tokens), makes that step wait for its predecessor
first. Speculative decoding and the KV tiers turn overlap off (EngineCore.__init__).

A mixin of `EngineCore` (engine/core.py), on the step thread only.
"""

from __future__ import annotations

import time

from llmserve.engine.backends.base import Backend
from llmserve.engine.core.step_worker import InFlight, StepRunner
from llmserve.engine.core.token_steps import TokenSteps
from llmserve.engine.frontend.outputs import FinishReason
from llmserve.engine.sched.plan import StepPlan
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.spec.verify import Verified


class OverlapSteps(TokenSteps):
    """EngineCore's overlapped step (see the module docstring); its tokens go out through TokenSteps' `_append`."""

    backend: Backend
    runner: StepRunner | None
    inflight: InFlight | None
    steps: int
    _failures: int

    def _expire_deadlines(self, now: float) -> None:
        raise NotImplementedError

    def _fail_step(self, plan: StepPlan, exc: Exception) -> None:
        raise NotImplementedError

    def overlap_step(self) -> None:
        """Launch the next step, then take the results of the one in flight (see the module docstring)."""
        assert self.runner is not None
        self._expire_deadlines(time.monotonic())
        previous = self.inflight
        if previous is not None and not self._may_plan_ahead():
            self.inflight = None
            self._land(previous)
            previous = None
        plan = self.scheduler.schedule()
        self.inflight = None
        if plan.seqs:
            now = time.monotonic()
            for entry in plan.seqs:
                if entry.seq.first_scheduled is None:
                    entry.seq.first_scheduled = now
            self.scheduler.launched(plan)  # before the next schedule, and before `previous` hands out its tokens
            self.inflight = InFlight.of(plan, self.runner.launch(self.backend, plan, previous))
        if previous is not None:
            self._land(previous)

    def drop_inflight(self) -> None:
        """Wait for the step in flight and drop its results (the core is ending every request)."""
        flight, self.inflight = self.inflight, None
        if flight is not None:
            flight.wait()
            self.scheduler.abandon(flight.plan)
            self._release_streams(flight)

    def _may_plan_ahead(self) -> bool:
        """Whether every sequence with a token in flight can have its next position planned before it is known."""
        for seq in self.scheduler.running:
            if seq.num_pending and not _plans_ahead(seq):
                return False
        return True

    def _land(self, flight: InFlight) -> None:
        """Take a done (or awaited) step's results: tokens to the sequences it still serves, then its books."""
        try:
            results = flight.future.result()
        except Exception as exc:
            self._land_failed(flight, exc)
            return
        self._failures = 0
        self.steps += 1
        now = time.monotonic()
        for entry, result in zip(flight.plan.sampling, results, strict=True):
            seq = entry.seq
            if seq.status is SeqStatus.FINISHED:
                continue  # ended meanwhile: its token is dropped
            if seq.num_preemptions != flight.epochs[seq.seq_no]:
                if not seq.request.sampling.greedy and seq.seed is not None:
                    self.backend.generators.rewind(seq.seq_no, seq.seed, seq.num_generated)
                continue
            seq.num_pending -= 1
            if isinstance(result, Verified):  # never launched ahead (scheduler.launched refuses drafts)
                raise TypeError("a step launched ahead returned a verification")
            self._append(seq, result, now)
        epochs = flight.epochs
        live = [
            entry
            for entry in flight.plan.seqs
            if entry.seq.status is not SeqStatus.FINISHED and entry.seq.num_preemptions == epochs[entry.seq.seq_no]
        ]
        self.scheduler.landed(flight.plan, live)
        self._release_streams(flight)

    def _land_failed(self, flight: InFlight, exc: Exception) -> None:
        """The step's forward raised: its requests fail, and so do those of the step launched after it, which
        computed placeholders for tokens that never came."""
        later, self.inflight = self.inflight, None
        if later is not None:
            later.wait()
        self._fail_step(flight.plan, exc)
        self._release_streams(flight)
        if later is not None:
            self.scheduler.abandon(later.plan)
            error = f"{type(exc).__name__}: {exc}"
            for entry in later.plan.seqs:
                if entry.seq.status is not SeqStatus.FINISHED:
                    self._finish(entry.seq, FinishReason.ERROR, error=error)
            self._release_streams(later)

    def _release_streams(self, flight: InFlight) -> None:
        for key in flight.releases:
            self.backend.generators.release(key)

    def _ended_in_flight(self, seq: Sequence) -> bool:
        """For `_finish`: keep only the KV that has landed of a sequence in the step in flight, and put off the
        release of its random stream until that step is done; False when no step in flight holds it."""
        flight = self.inflight
        start = None if flight is None else flight.starts.get(seq.seq_no)
        if flight is None or start is None:
            return False
        seq.num_computed = min(seq.num_computed, start)
        seq.num_pending = 0
        flight.releases.append(seq.seq_no)
        return True


def _plans_ahead(seq: Sequence) -> bool:
    """A sequence whose next step needs no more of the token in flight than its id (see the module docstring)."""
    params = seq.request.sampling
    return (
        seq.constraint is None
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
    )
