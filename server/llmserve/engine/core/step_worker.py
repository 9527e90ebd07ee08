"""Overlap's runner (--async-scheduling): a backend's steps on a worker thread of their own, so that the step thread
plans and stages step N+1 and hands out step N's tokens while step N's forward runs.

Steps run one at a time in launch order (one worker), so everything a step writes (KV, the input batch, the
random streams) is written before the next step reads it, as on one device stream. A step planned while its
predecessor ran computes each decoding sequence's next position with a placeholder (plan.PENDING): the worker
puts the token the predecessor sampled in its place just before the forward, which is the first moment it is
known. On a CPU the forward holds the cores and the step thread's work is small beside it, so little is gained
there; on CUDA the worker waits on the device (the GIL released) while the step thread works. Reading the sampled
tokens back later (a non-blocking device-to-host copy and an event, the placeholders filled on the device, as
vLLM's async scheduling does) is the next step and is not built: here the forward and its sampling stay one
`Backend.execute`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from llmserve.engine.backends.base import Backend
from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sched.plan import PENDING, StepPlan
from llmserve.engine.spec.verify import Verified

Results = list[Sampled | RowFailed | Verified]


@dataclass(slots=True)
class InFlight:
    """A launched step whose results the step thread has not taken yet.

    `starts`: each sequence's first position in it (what was computed before it: a sequence that ends meanwhile
    keeps only that much KV); `epochs`: each sequence's preemption count at launch (a sequence preempted since
    gets nothing from it); `releases`: random streams of sequences that ended meanwhile, dropped once the step is
    done (it may still draw from them)."""

    plan: StepPlan
    future: Future[Results]
    starts: dict[int, int]
    epochs: dict[int, int]
    releases: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, plan: StepPlan, future: Future[Results]) -> InFlight:
        starts = {entry.seq.seq_no: entry.start for entry in plan.seqs}
        epochs = {entry.seq.seq_no: entry.seq.num_preemptions for entry in plan.seqs}
        return cls(plan, future, starts, epochs)

    def wait(self) -> None:
        """Until the step is done, whether it succeeded or not."""
        try:
            self.future.result()
        except Exception:  # the caller that takes the results hears of it
            pass


class StepRunner:
    """Runs `backend.execute` for each launched plan on one worker thread, in launch order."""

    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-step")

    def launch(self, backend: Backend, plan: StepPlan, previous: InFlight | None) -> Future[Results]:
        """Queue the plan's step on `backend`; `previous`: the step launched before it, whose sampled tokens fill
        its placeholders."""
        return self._worker.submit(_run, backend, plan, previous)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _run(backend: Backend, plan: StepPlan, previous: InFlight | None) -> Results:
    if previous is not None:
        fill_pending(plan, previous)
    return backend.execute(plan)


def fill_pending(plan: StepPlan, previous: InFlight) -> None:
    """Put the tokens `previous` sampled in place of the plan's placeholders. A sequence whose row failed, or all of
    them when the previous forward failed, gets token 0: it has ended by the time this step's results are taken,
    so that token's output is dropped (and a failed previous step fails this one: core_overlap)."""
    if not any(PENDING in entry.token_ids for entry in plan.seqs):
        return
    tokens: dict[int, int] = {}
    if previous.future.exception() is None:  # done: the worker ran it just before this one
        for entry, result in zip(previous.plan.sampling, previous.future.result(), strict=True):
            if isinstance(result, Sampled):
                tokens[entry.seq.seq_no] = result.token_id
    for entry in plan.seqs:
        ids = entry.token_ids
        if PENDING in ids:
            assert isinstance(ids, list)  # step_of's own list, never the sequence's
            ids[ids.index(PENDING)] = tokens.get(entry.seq.seq_no, 0)
