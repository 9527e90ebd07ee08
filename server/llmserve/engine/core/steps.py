"""How a step runs, and where its sampled tokens go.

The engine core holds one step runner, chosen once at start:

- `PlainRunner`: one step at a time. Expire deadlines; finish the KV tiers' loads; ask speculation for drafts;
  schedule (the scheduler's `StepPlan`); give LoRA entries their slots; start the tiers' copies; run the backend
  (one forward, the rows that sample); update the books; hand each sampled token to its request. A step without
  drafts samples through the sampler alone; a step with drafts has speculation verify them (spec/).
- `OverlapRunner` (--async-scheduling): plan and launch step N+1 before taking step N's tokens (below).

Neither restates the other: both stamp a plan's start (`started`), count a step and hand out each token through the
core that holds them (`StepHost`), whose `TokenSink` appends tokens one by one through the stop checks. A core
without overlap never calls overlap code.

The overlapped step. One `OverlapRunner.step`: expire deadlines; schedule step N+1, which gives each sequence still
decoding in step N its next position with a placeholder (the token N samples: Sequence.num_pending, plan.PENDING);
launch it on the worker, which starts it once step N is done; then take step N's results, waiting for them if they
are not in, and hand its tokens out as a plain step does. So the step thread's schedule, books and outputs of one
step run while the forward of the next one does. What a plain step guarantees holds:
- tokens are handed out in order, one step's after the previous one's;
- a command drained between two calls (an abort, a stop string's abort) acts at once: the request's final output
  is collected then, and the token a step already in flight samples for it is dropped when that step lands;
- a sequence that ended or was preempted after a step was launched gets nothing from it; its KV past what had
  landed is never kept for a session or registered for prefix caching, and a preempted sampled sequence's random
  stream is rewound to the draws of the tokens it kept (so that it samples the dropped position again as it did);
- a token made unwanted by a later stop (EOS, a stop token or string, max_new_tokens) is dropped: no step is
  planned past a length the tokens in flight reach, and an EOS or stop in step N leaves step N+1's row for that
  sequence computed but unused.
A step plans ahead only where the next token's inputs do not depend on the token in flight beyond its id: a sequence
in flight with a constraint (its grammar must take the token before the next mask), or with repetition, frequency or
presence penalties (which read the generated tokens), makes that step wait for its predecessor first. Speculative
decoding, LoRA and the KV tiers turn overlap off (EngineCore).

The worker runs the launched steps one at a time in launch order, so everything a step writes (KV, the input batch,
the random streams) is written before the next step reads it, as on one device stream. It puts the token the
predecessor sampled in place of each placeholder just before the forward, the first moment it is known. On a CPU the
forward holds the cores and the step thread's work is small beside it, so little is gained there; on CUDA the worker
waits on the device (the GIL released) while the step thread works. Reading the sampled tokens back later (a
non-blocking device-to-host copy and an event, the placeholders filled on the device, as vLLM's async scheduling
does) is the next step and is not built: here the forward and its sampling stay one `Backend.execute`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeAlias, cast

from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sched.plan import PENDING, SeqStep, StepPlan
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.spec.verify import Verified
from llmserve.engine.types.outputs import EngineOutput, FinishReason, RequestStart

if TYPE_CHECKING:
    from llmserve.engine.backends.base import Backend, StepResult
    from llmserve.engine.kv_tiers.worker import KVTiers
    from llmserve.engine.lora.serving import LoraServing
    from llmserve.engine.sched.scheduler import Scheduler
    from llmserve.engine.spec.speculation import Speculation

Results: TypeAlias = "Seq[StepResult]"


class StepHost(Protocol):
    """What a step runner uses of the core that holds it (EngineCore): its books and backend, and the core's own
    part of a step (deadlines, a failed step, handing a token to its request, retiring one)."""

    scheduler: Scheduler
    backend: Backend
    sink: TokenSink

    @property
    def speculation(self) -> Speculation | None: ...  # None when off (or when measuring its cost failed)

    def expire_deadlines(self, now: float) -> None: ...

    def fail_step(self, plan: StepPlan, exc: Exception) -> None: ...

    def stepped(self) -> None: ...  # a forward succeeded

    def hand_out(self, seq: Sequence, result: StepResult, now: float) -> None: ...

    def deliver(self, seq: Sequence, appended: Appended) -> None: ...

    def finish(
        self, seq: Sequence, reason: FinishReason, *, output: EngineOutput | None = None, error: str | None = None
    ) -> None: ...


class StepRunner(Protocol):
    """How the core's steps run (PlainRunner or OverlapRunner, chosen once at start)."""

    @property
    def in_flight(self) -> bool: ...  # a step was launched whose results are not taken yet

    def step(self) -> None: ...

    def retire(self, seq: Sequence) -> bool: ...  # see OverlapRunner.retire

    def drop(self) -> None: ...  # the core ends every request: a step in flight is waited for, its results dropped

    def close(self) -> None: ...


def started(plan: StepPlan, now: float) -> None:
    """The plan's sequences are scheduled for the first time at `now`, those that were not already."""
    for entry in plan.seqs:
        if entry.seq.first_scheduled is None:
            entry.seq.first_scheduled = now


# -- the token sink -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Appended:
    """What appending a step's tokens to one request gave: its output (the tokens appended, their logprobs, the
    accounts of its first token), and the reason it ended, if a token ended it (ERROR: the constraint refused a
    token, `error` says which; the output is then dropped, the request fails)."""

    output: EngineOutput
    reason: FinishReason | None = None
    error: str | None = None


class TokenSink:
    """Appends sampled tokens to their sequence one by one, each through the stop checks, up to the first that ends
    it: the constraint's acceptance, stop tokens, EOS, the constraint's completion, max_new_tokens and the context
    (`max_model_len`), in that order. The one place a token joins a request."""

    __slots__ = ("max_model_len",)

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, samples: Seq[Sampled], now: float) -> Appended:
        appended = Appended(EngineOutput(seq.seq_no, seq.request_id, [], None))
        for sampled in samples:
            self._take(seq, sampled, appended, now)
            if appended.reason is not None:
                break
        return appended

    def _take(self, seq: Sequence, sampled: Sampled, appended: Appended, now: float) -> None:
        token_id = sampled.token_id
        output = appended.output
        seq.token_ids.append(token_id)
        output.token_ids.append(token_id)
        if sampled.logprob is not None:
            if output.logprobs is None:
                output.logprobs = []
            output.logprobs.append(sampled.logprob)
        if seq.first_token is None:
            output.prompt_logprobs = sampled.prompt
            seq.first_token = now
            began = seq.first_scheduled if seq.first_scheduled is not None else now
            output.start = RequestStart(
                seq.num_prompt, seq.num_cached_prompt, seq.seed, seq.arrival, began - seq.arrival, now - seq.arrival
            )
        constraint = seq.constraint
        if constraint is not None and not constraint.accept(token_id):  # the mask let through what it forbids
            appended.reason = FinishReason.ERROR
            appended.error = f"the constraint rejected token {token_id}: {constraint.error}"
        elif token_id in seq.stop_ids:
            appended.reason = FinishReason.STOP_TOKEN
        elif token_id in seq.eos_ids:
            appended.reason = FinishReason.EOS
        elif constraint is not None and constraint.done:  # complete: only the end could follow
            appended.reason = FinishReason.CONSTRAINT
        elif seq.num_generated >= seq.request.stopping.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
            appended.reason = FinishReason.LENGTH


# -- one step at a time -------------------------------------------------------------------------------------


class PlainRunner:
    """One step at a time (see the module docstring). `tiers` and `lora`: the core's KV tiers and adapters, None
    when off; `max_num_seqs` and `max_num_batched_tokens`: the limits drafts are fitted within."""

    def __init__(
        self,
        host: StepHost,
        tiers: KVTiers | None,
        lora: LoraServing | None,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.host = host
        self.tiers = tiers
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    @property
    def in_flight(self) -> bool:
        return False

    def step(self) -> None:
        host, tiers, lora = self.host, self.tiers, self.lora
        scheduler, speculation = host.scheduler, host.speculation
        now = time.monotonic()
        host.expire_deadlines(now)
        if tiers is not None:
            tiers.finish_loads(scheduler.load_done)
        drafts = None
        if speculation is not None:
            drafts = speculation.drafts(scheduler, self.max_num_seqs, self.max_num_batched_tokens)
        plan = scheduler.schedule(drafts) if drafts else scheduler.schedule()
        if lora is not None:  # each entry's adapter slot (drafts included), and the adapters to copy in
            lora.assign(plan, [entry.seq.lora for entry in plan.seqs])
        if tiers is not None:
            tiers.begin(plan)  # before the forward, which may overwrite the blocks evicted for it
        if not plan.seqs:
            if tiers is not None:
                tiers.wait(0.05)  # only loads to wait for (if any): sleep until one ends rather than spin
            return
        started(plan, now)
        try:
            # With drafts: every position's sample row, and each sampled stream as it stands before the draws.
            verification = None if speculation is None else speculation.verify(plan, host.backend.mark_stream)
            results = host.backend.execute(plan)
        except Exception as exc:  # a bad batch must not take the server down
            host.fail_step(plan, exc)
            return
        host.stepped()
        emit_time = time.monotonic()
        scheduler.update(plan)
        if verification is None:
            for entry, result in zip(plan.sampling, results, strict=True):
                host.hand_out(entry.seq, result, emit_time)
            return
        assert speculation is not None
        speculation.step_verified()
        # A pooling request never has drafts: its Pooled passes through as a plain entry's result, to hand_out.
        for entry, verdict in verification.verdicts(plan.sampling, cast("Seq[Sampled | RowFailed]", results)):
            if entry.drafts:
                self._hand_out_verified(entry, verdict, emit_time, speculation)
            else:
                assert not isinstance(verdict, Verified)
                host.hand_out(entry.seq, verdict, emit_time)

    def _hand_out_verified(
        self, entry: SeqStep, result: Verified | Sampled | RowFailed, now: float, speculation: Speculation
    ) -> None:
        """A sequence's verification: its emitted tokens through the sink, up to the first that ends it; the books
        of its drafts' KV kept before it can finish (the accepted drafts it kept are computed, the rest dropped);
        then its acceptance counted."""
        host, seq = self.host, entry.seq
        if not isinstance(result, Verified):  # a position's sampling failed: the request fails
            speculation.settle(host.scheduler, entry)
            host.hand_out(seq, result, now)
            return
        appended = host.sink.append(seq, result.samples, now)
        if appended.reason is not FinishReason.ERROR:  # refused by its constraint: it fails, its blocks with it
            speculation.settle(host.scheduler, entry)
        host.deliver(seq, appended)
        speculation.observe(entry, result.accepted)

    def retire(self, seq: Sequence) -> bool:
        return False  # no step outlives the call that ran it

    def drop(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- overlapped steps ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class LaunchedStep:
    """A step launched on the worker whose results the step thread has not taken yet.

    `starts`: each sequence's first position in it (what was computed before it: a sequence that ends meanwhile
    keeps only that much KV); `epochs`: each sequence's preemption count at launch (a sequence preempted since
    gets nothing from it); `releases`: sequences that ended meanwhile, whose state in the backend (random streams,
    pooling, prompt logprobs) is released once the step is done (it may still read it)."""

    plan: StepPlan
    future: Future[Results]
    starts: dict[int, int]
    epochs: dict[int, int]
    releases: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, plan: StepPlan, future: Future[Results]) -> LaunchedStep:
        starts = {entry.seq.seq_no: entry.start for entry in plan.seqs}
        epochs = {entry.seq.seq_no: entry.seq.num_preemptions for entry in plan.seqs}
        return cls(plan, future, starts, epochs)

    def wait(self) -> None:
        """Until the step is done, whether it succeeded or not."""
        try:
            self.future.result()
        except Exception:  # the caller that takes the results hears of it
            pass


class StepWorker:
    """Runs `backend.execute` for each launched plan on one worker thread, in launch order."""

    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-step")

    def launch(self, backend: Backend, plan: StepPlan, previous: LaunchedStep | None) -> Future[Results]:
        """Queue the plan's step on `backend`; `previous`: the step launched before it, whose sampled tokens fill
        its placeholders."""
        return self._worker.submit(_run, backend, plan, previous)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _run(backend: Backend, plan: StepPlan, previous: LaunchedStep | None) -> Results:
    if previous is not None:
        fill_pending(plan, previous)
    return backend.execute(plan)


def fill_pending(plan: StepPlan, previous: LaunchedStep) -> None:
    """Put the tokens `previous` sampled in place of the plan's placeholders. A sequence whose row failed, or all of
    them when the previous forward failed, gets token 0: it has ended by the time this step's results are taken,
    so that token's output is dropped (and a failed previous step fails this one: OverlapRunner._land_failed)."""
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


class OverlapRunner:
    """Steps launched ahead of their predecessor's tokens (see the module docstring), on one worker thread."""

    def __init__(self, host: StepHost) -> None:
        self.host = host
        self.launched: LaunchedStep | None = None
        self.worker = StepWorker()

    @property
    def in_flight(self) -> bool:
        return self.launched is not None

    def step(self) -> None:
        """Launch the next step, then take the results of the one in flight."""
        host = self.host
        scheduler = host.scheduler
        host.expire_deadlines(time.monotonic())
        previous = self.launched
        if previous is not None and not self._may_plan_ahead():
            self.launched = None
            self._land(previous)
            previous = None
        plan = scheduler.schedule()
        self.launched = None
        if plan.seqs:
            started(plan, time.monotonic())
            scheduler.launched(plan)  # before the next schedule, and before `previous` hands out its tokens
            self.launched = LaunchedStep.of(plan, self.worker.launch(host.backend, plan, previous))
        if previous is not None:
            self._land(previous)

    def retire(self, seq: Sequence) -> bool:
        """A sequence ends: keep only the KV that has landed of it if the step in flight holds it, and put off the
        release of its state in the backend until that step is done; False when no step in flight holds it."""
        launched = self.launched
        start = None if launched is None else launched.starts.get(seq.seq_no)
        if launched is None or start is None:
            return False
        seq.num_computed = min(seq.num_computed, start)
        seq.num_pending = 0
        launched.releases.append(seq.seq_no)
        return True

    def drop(self) -> None:
        """Wait for the step in flight and drop its results (the core is ending every request)."""
        launched, self.launched = self.launched, None
        if launched is not None:
            launched.wait()
            self.host.scheduler.abandon(launched.plan)
            self._release(launched)

    def close(self) -> None:
        self.worker.close()

    def _may_plan_ahead(self) -> bool:
        """Whether every sequence with a token in flight can have its next position planned before it is known."""
        for seq in self.host.scheduler.running:
            if seq.num_pending and not _plans_ahead(seq):
                return False
        return True

    def _land(self, launched: LaunchedStep) -> None:
        """Take a done (or awaited) step's results: tokens to the sequences it still serves, then its books."""
        host = self.host
        try:
            results = launched.future.result()
        except Exception as exc:
            self._land_failed(launched, exc)
            return
        host.stepped()
        now = time.monotonic()
        epochs = launched.epochs
        for entry, result in zip(launched.plan.sampling, results, strict=True):
            seq = entry.seq
            if seq.status is SeqStatus.FINISHED:
                continue  # ended meanwhile: its token is dropped
            if seq.num_preemptions != epochs[seq.seq_no]:
                if not seq.request.sampling.greedy and seq.seed is not None:
                    host.backend.rewind_stream(seq.seq_no, seq.seed, seq.num_generated)
                continue
            seq.num_pending -= 1
            host.hand_out(seq, result, now)
        live = [
            entry
            for entry in launched.plan.seqs
            if entry.seq.status is not SeqStatus.FINISHED and entry.seq.num_preemptions == epochs[entry.seq.seq_no]
        ]
        host.scheduler.landed(launched.plan, live)
        self._release(launched)

    def _land_failed(self, launched: LaunchedStep, exc: Exception) -> None:
        """The step's forward raised: its requests fail, and so do those of the step launched after it, which
        computed placeholders for tokens that never came."""
        host = self.host
        later, self.launched = self.launched, None
        if later is not None:
            later.wait()
        host.fail_step(launched.plan, exc)
        self._release(launched)
        if later is not None:
            host.scheduler.abandon(later.plan)
            error = f"{type(exc).__name__}: {exc}"
            for entry in later.plan.seqs:
                if entry.seq.status is not SeqStatus.FINISHED:
                    host.finish(entry.seq, FinishReason.ERROR, error=error)
            self._release(later)

    def _release(self, launched: LaunchedStep) -> None:
        for key in launched.releases:
            self.host.backend.release(key)


def _plans_ahead(seq: Sequence) -> bool:
    """A sequence whose next step needs no more of the token in flight than its id (see the module docstring)."""
    params = seq.request.sampling
    return (
        seq.constraint is None
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
    )
