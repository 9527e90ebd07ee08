"""The engine's step loop: typed commands in, one step at a time, token outputs out.

A step reads as its five parts: drain the inbox (`Add`, `Abort`, session and adapter queries), schedule (the
scheduler's `StepPlan`), execute (the backend: one forward, the rows that sample), update the books, collect each
request's `EngineOutput` (token ids, logprobs, finish facts; no text). `run()` hands each pass's outputs to its
`emit`; the front end (frontend/async_engine.py, frontend/output_processor.py) owns text, stop strings and deltas.

`EngineCore` owns the books (scheduler, sessions, block pool), the backend and the constraint compiler, and holds
its collaborators, each chosen once at start: how a step runs (`runner`: core/steps.py's PlainRunner, or its
OverlapRunner with --async-scheduling), where a step's tokens go (`sink`: steps.TokenSink, the stop checks), the
LoRA adapters' books (`lora`, lora/serving.py), the lower KV tiers (`tiers`, kv_tiers/worker.py) and speculative
decoding (`speculation`, spec/speculation.py), each None when off; and the metrics' snapshot (`stats`). The core
itself admits requests, retires them (every way a request ends goes through `finish`) and collects outputs.

The step thread owns all engine state and takes no lock: other threads only put commands in the inbox (queries
answered through a future) and read `stats()`. A request's grammar is compiled on the compiler's workers while it
waits in `compiling`. The loop runs on a thread (`ThreadCore`, below) or in an engine process of its own
(core/process.py's ProcessCore).
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from concurrent.futures import Future
from typing import TypeVar

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.base import BlockCopier, StepResult
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.client import (
    STOPPED,
    Abort,
    Add,
    ClientRequests,
    Command,
    DeleteSession,
    Emit,
    GetSession,
    ManageAdapters,
)
from llmserve.engine.core.compiling import Compiling
from llmserve.engine.core.pooling_cost import POOLED, StepCost
from llmserve.engine.core.pooling_cost import measure as measure_step_cost
from llmserve.engine.core.stats import CoreStats
from llmserve.engine.core.steps import Appended, OverlapRunner, PlainRunner, StepRunner, TokenSink
from llmserve.engine.kv_tiers.worker import build_tiers
from llmserve.engine.lora.serving import LoraOff, LoraServing
from llmserve.engine.sample.constraints import ConstraintCompiler, ConstraintState, Vocabulary
from llmserve.engine.sample.sampler import RowFailed
from llmserve.engine.sched.block_pool import BlockPool
from llmserve.engine.sched.kv_events import KvEventLog
from llmserve.engine.sched.plan import Pooled, StepPlan
from llmserve.engine.sched.scheduler import POOLING_MIN_CHUNK, Scheduler
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.sched.sessions import SessionStore
from llmserve.engine.spec.speculation import Speculation
from llmserve.engine.types.adapters import AdapterAnswer, AdapterOp, ListAdapters, LoadAdapter
from llmserve.engine.types.errors import EngineDead
from llmserve.engine.types.kv_cache import KvEvent
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.outputs import EngineOutput, FinishReason, ended, ended_unstarted
from llmserve.engine.types.protocol import EngineStats, SessionInfo
from llmserve.engine.types.request import CoreFacts, GenerationRequest, PoolingParams, StoppingParams

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 3
Query = TypeVar("Query", GetSession, DeleteSession, ManageAdapters)


class EngineCore:
    """Owns scheduler, sessions, block pool, backend and constraint compiler, and holds its collaborators (see the
    module docstring); `step()` is one iteration. The step thread alone calls step() and run(); other threads only
    submit, abort, ask about sessions and adapters, wake and read stats.
    `vocabulary`: the grammar vocabulary to share with a front end in this process (built once per process); by
    default the model's own (none without a tokenizer)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, vocabulary: Vocabulary | None = None) -> None:
        self.loaded = loaded
        self.config = config
        self.sliding_window = loaded.shape.sliding_window
        self.max_model_len = context_cap(config.max_model_len, loaded.context_length, self.sliding_window)
        self.backend = create_backend(loaded, config, self.max_model_len)
        # An encoder keeps no KV: nothing to reuse from a prefix or a session, and each input is read whole.
        encoder = loaded.encoder
        # Lower KV tiers (--kv-offload-*): raises DiskTierError naming the flag when they cannot be had.
        self.tiers = build_tiers(config, loaded, BlockCopier(self.backend.kv))
        self.pool = BlockPool(
            self.backend.num_blocks, config.block_size, track_evictions=self.tiers is not None, events=KvEventLog()
        )
        self.sessions = SessionStore(
            self.pool,
            ttl_s=config.session_ttl_s,
            max_sessions=config.max_sessions,
            max_pool_fraction=config.session_pool_fraction,
        )
        self.scheduler = Scheduler(
            self.pool,
            self.sessions,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching and not encoder,
            tiers=self.tiers,
            max_loras=config.max_loras,
            whole_prompts=encoder,
            pooling_share=config.pooling_share,
            pooling_step_tokens=config.pooling_step_tokens or 0,
        )
        # The pooling cap's F: the config's, else measured once before serving where it applies (pooling_cost.py).
        self.pooling_cost: StepCost | None = None
        self._pooling_cost_due = (
            config.pooling_step_tokens is None
            and config.pooling_share < 1.0
            and loaded.generates
            and loaded.pooling is not None
            and not encoder
        )
        self.lora = LoraServing.of(config, loaded.shape)  # the adapters' books; None unless LoRA is on
        if self.tiers is not None:
            self.tiers.start()
        self.speculation = Speculation.of(config, self.max_model_len)  # spec/; None when off
        self.sink = TokenSink(self.max_model_len)
        vocabulary = vocabulary if vocabulary is not None else Vocabulary.for_model(loaded)
        compiler = None if vocabulary is None else ConstraintCompiler(vocabulary, config.constraint_cache_size)
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._inbox_lock = threading.Lock()  # with _closed: nothing enters the inbox after its last drain
        self._closed = False
        self._wake = threading.Event()
        self._handles = itertools.count(1)  # also each sequence's arrival order (seq_no)
        self._collected: list[EngineOutput] = []  # this pass's outputs, until take_outputs()
        self.compiling = Compiling(compiler, self._wake.set)  # constrained requests until their matcher exists
        self._failures = 0
        self.dead_reason: str | None = None
        self.steps = 0  # forwards that succeeded
        self._stats = CoreStats(self.pool, self.sessions, self.scheduler, self.compiling, self.tiers, self.lora)
        # How a step runs, chosen once: overlapped (--async-scheduling) unless a feature that steps without it is on.
        overlap = (
            config.async_scheduling
            and self.speculation is None
            and self.tiers is None
            and self.lora is None
            and loaded.pooling is None  # a pooling request ends at its last chunk: no next position to plan ahead
        )
        if config.async_scheduling and not overlap:
            log.warning("--async-scheduling is off: speculative decoding, the KV tiers and LoRA step without overlap")
        self.runner: StepRunner = (
            OverlapRunner(self)
            if overlap
            else PlainRunner(
                self,
                self.tiers,
                self.lora,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
        )
        self.facts = CoreFacts(  # what the front end checks requests against (request.validate)
            self.max_model_len,
            self.sliding_window,
            loaded.vocab_size,
            self.pool.num_blocks,
            config.block_size,
            config.max_top_logprobs,
            config.max_n,
            self.backend.name,
            self.backend.description,
            None if self.lora is None else self.lora.apply(ListAdapters()),
            generates=loaded.generates,
            pools=loaded.pooling is not None,
            max_pooling_tokens=pooling_limit(loaded, self.max_model_len, config.max_num_batched_tokens),
        )

    # -- called from any thread ------------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, after: int | None = None, handle: int | None = None) -> int:
        """Queue a request (checked by request.validate) under `handle` (a client numbers its own, increasing) or the
        next; returns it. `after`: the handle of completion 0 of the same n > 1 request, whose prompt KV this one
        waits for and shares. Raises EngineDead once the step loop has ended."""
        if handle is None:
            handle = next(self._handles)
        if not self._put(Add(handle, request, time.monotonic(), after)):
            raise EngineDead(STOPPED)
        return handle

    def abort(self, handle: int, keep_generated: int | None = None) -> None:
        """End a request (see `Abort`); a handle that already finished is ignored."""
        self._put(Abort(handle, keep_generated))

    def get_session(self, session_id: str) -> Future[SessionInfo | None]:
        """What the core holds for a session, answered when the inbox is next drained (within a step)."""
        return self._ask(GetSession(session_id, Future())).reply

    def delete_session(self, session_id: str) -> Future[bool]:
        """Free what the core holds for a session; the answer says whether it held anything."""
        return self._ask(DeleteSession(session_id, Future())).reply

    def wake(self) -> None:
        self._wake.set()  # an idle step loop looks at its inbox and stop flag now

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def stats(self) -> EngineStats:
        return self._stats.snapshot(self.speculation)  # read without a lock: a scrape never stalls a step

    def manage_adapters(self, op: AdapterOp) -> Future[AdapterAnswer]:
        """An AdapterService call, answered when the inbox is next drained: a load's files are read first on a
        thread of its own (a slow disk holds up neither the caller nor the step loop), then the step thread changes
        the books."""
        lora = self.lora
        reply: Future[AdapterAnswer] = Future()
        if lora is None:
            reply.set_exception(LoraOff())
            return reply

        def read_then_ask() -> None:
            try:
                adapter = lora.prepare(op)
            except Exception as exc:  # AdapterNotFound, AdapterRefused: the caller's answer
                reply.set_exception(exc)
                return
            self._ask(ManageAdapters(op, adapter, reply))

        if isinstance(op, LoadAdapter):
            threading.Thread(target=read_then_ask, name="llmserve-lora-read", daemon=True).start()
        else:
            self._ask(ManageAdapters(op, None, reply))
        return reply

    # -- the step thread -------------------------------------------------------------------------

    def run(self, stop: threading.Event, emit: Emit) -> None:
        """Step until `stop` is set (then `wake()`), handing each pass's outputs to `emit` in one call; then end
        the rest: the inbox is closed and drained (every session query is answered), whatever is left ends
        CANCELLED, and the tiers and the compiler close."""
        self._calibrate_speculation()
        self._measure_pooling_cost()
        while not stop.is_set():
            self.drain_inbox()
            self._emit_pending(emit)  # the final outputs of aborted requests, at once (none: nothing to do)
            if not self.scheduler.has_work and not self.runner.in_flight:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # a fault in the books, not in a forward: fail every request, never hang them
                log.exception("engine step failed")
                self._die(f"engine step failed: {type(exc).__name__}: {exc}")
            self._emit_pending(emit)
        with self._inbox_lock:
            self._closed = True
        self.drain_inbox()
        self._end_all(FinishReason.CANCELLED, None)
        self._emit_pending(emit)
        self.close_tiers()
        self.compiling.close()
        self.runner.close()

    def warm_up(self) -> None:
        """One short generation stepped on this thread, before the step loop starts (its outputs are dropped)."""
        stopping = StoppingParams(max_new_tokens=2, ignore_eos=True)
        config = self.loaded.pooling
        pooling = None if self.loaded.generates or config is None else PoolingParams(config.mode)
        request = GenerationRequest("warm-up", (0,) * 8, stopping=stopping, pooling=pooling)
        self.submit(request, handle=0)  # 0: no client's (clients number from 1)
        while not any(out.handle == 0 and out.finished for out in self.take_outputs()):
            self.drain_inbox()
            self.step()
        self._calibrate_speculation()
        self._measure_pooling_cost()

    def close_tiers(self) -> None:
        """Write every hashed block still in the pool to the tiers and finish their writes (at shutdown, on the
        thread that stepped: a restarted server finds the conversations on disk). Idempotent."""
        if self.tiers is not None:
            self.tiers.write_back(self.pool)
            self.tiers.close()

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's stored and removed blocks since the last call (any thread may take them)."""
        assert self.pool.events is not None
        return self.pool.events.take()

    def take_outputs(self) -> list[EngineOutput]:
        """The outputs collected since the last call (commands drained, steps taken), in order."""
        outputs, self._collected = self._collected, []
        return outputs

    def step(self) -> None:
        """One iteration, as the runner chosen at start runs it (core/steps.py)."""
        self.runner.step()

    def add_now(self, request: GenerationRequest, handle: int) -> None:
        """Start an unconstrained request at once, past the inbox (the step thread only: the calibration's own
        requests, which must not drain callers' commands; negative handles, which no client uses)."""
        self._admit(Add(handle, request, time.monotonic()), None)

    def cancel_now(self, handle: int) -> None:
        """End a request started by add_now at once (the step thread only); its outputs are the caller's to drop."""
        seq = self.scheduler.live.get(handle)
        if seq is not None:
            self.finish(seq, FinishReason.CANCELLED)

    def drain_inbox(self) -> None:
        """Apply every queued command, then admit the requests whose grammar has compiled meanwhile (on the step
        thread, or the thread that steps by hand)."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add):
                self._add(command)
            elif self.dead_reason is not None and not isinstance(command, Abort):  # a dead core answers nothing
                command.reply.set_exception(EngineDead(self.dead_reason))
            elif isinstance(command, GetSession):
                command.reply.set_result(self.sessions.info(command.session_id, self.tiers))
            elif isinstance(command, DeleteSession):
                command.reply.set_result(self.sessions.delete(command.session_id))
            elif isinstance(command, ManageAdapters):
                self._apply_adapters(command)
            else:
                self._abort(command)
        if self.compiling:
            for late in self.compiling.expired(time.monotonic()):
                self._end_unstarted(late, FinishReason.DEADLINE)
            for add, state in self.compiling.ready():
                if isinstance(state, str):
                    self._end_unstarted(add, FinishReason.ERROR, state)
                else:
                    self._admit(add, state)

    # -- a step's part on the core (steps.StepHost) ----------------------------------------------

    def expire_deadlines(self, now: float) -> None:
        live = self.scheduler.live.values()
        for seq in [s for s in live if s.request.deadline is not None and s.request.deadline <= now]:
            self.finish(seq, FinishReason.DEADLINE)

    def stepped(self) -> None:
        """A forward succeeded."""
        self._failures = 0
        self.steps += 1

    def fail_step(self, plan: StepPlan, exc: Exception) -> None:
        """The shared forward raised: every request in it fails, and none of their KV may be reused."""
        log.error("forward failed for %d requests", len(plan.seqs), exc_info=exc)
        error = f"{type(exc).__name__}: {exc}"
        self._failures += 1
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            # Set before the batch hears of its failure, so that callers see a dead engine at once.
            self.dead_reason = f"{MAX_CONSECUTIVE_FAILURES} consecutive failed steps, last: {error}"
        self.scheduler.abandon(plan)
        for entry in plan.seqs:
            if entry.seq.status is not SeqStatus.FINISHED:
                self.finish(entry.seq, FinishReason.ERROR, error=error)
        if self.dead_reason is not None:
            self._die(self.dead_reason)

    def hand_out(self, seq: Sequence, result: StepResult, now: float) -> None:
        """A sampled token to its request, through the sink's stop checks; a failed row is that request's alone; a
        pooling request's vector ends it (LENGTH: its prompt is read), its blocks freed."""
        if isinstance(result, RowFailed):
            self.finish(seq, FinishReason.ERROR, error=result.error)
        elif isinstance(result, Pooled):
            seq.first_token = now
            output = EngineOutput(seq.seq_no, seq.request_id, [], embedding=result.values)
            self.finish(seq, FinishReason.LENGTH, output=output)
        else:
            self.deliver(seq, self.sink.append(seq, (result,), now))

    def deliver(self, seq: Sequence, appended: Appended) -> None:
        """Collect a request's output, or finish the request with it when a token ended it (a token its constraint
        refused fails it: that output is dropped)."""
        if appended.reason is None:
            self._collected.append(appended.output)
        elif appended.reason is FinishReason.ERROR:
            self.finish(seq, FinishReason.ERROR, error=appended.error)
        else:
            self.finish(seq, appended.reason, output=appended.output)

    def finish(
        self, seq: Sequence, reason: FinishReason, *, output: EngineOutput | None = None, error: str | None = None
    ) -> None:
        """Retire a live request (every way a request ends comes here) and collect its final output; its random
        state in the backend goes with it (once a step in flight that may read it is done, runner.retire)."""
        in_flight = self.runner.retire(seq)
        self.scheduler.finish(seq, reason)
        if self.lora is not None:
            self.lora.unbind(seq)
        if not in_flight:  # else once the step in flight that may read it has landed (runner.retire)
            self.backend.release(seq.seq_no)
        if self.speculation is not None:
            self.speculation.release(seq)
        usage, timing = seq.ended(time.monotonic())
        final = ended(seq.seq_no, seq.request_id, reason, usage, timing, seed=seq.seed, error=error, last=output)
        self._collected.append(final)

    # -- internals -------------------------------------------------------------------------------

    def _emit_pending(self, emit: Emit) -> None:
        if self._collected:
            emit(self.take_outputs())

    def _ask(self, query: Query) -> Query:
        if not self._put(query):  # the loop ended: its last drain is done, nobody would answer
            query.reply.set_exception(EngineDead(STOPPED))
        return query

    def _put(self, command: Command) -> bool:
        """Queue a command for the step thread; False once the inbox has closed (the loop ended)."""
        with self._inbox_lock:
            if self._closed:
                return False
            self._inbox.put(command)
        self._wake.set()
        return True

    def _add(self, command: Add) -> None:
        spec = command.request.constraint
        if self.dead_reason is not None:
            self._end_unstarted(command, FinishReason.ERROR, self.dead_reason)
        elif spec is None:
            self._admit(command, None)
        else:
            self.compiling.add(command, spec)

    def _admit(self, command: Add, constraint: ConstraintState | None) -> None:
        request = command.request
        seq = Sequence.of(request, command.handle, command.arrival, self.loaded.eos_token_ids, constraint)
        if command.after is not None:  # None when it already finished: then there is nothing to wait for
            seq.after = self.scheduler.live.get(command.after)
        seq.length_limit = min(self.max_model_len, seq.num_prompt + request.stopping.max_new_tokens)
        params = request.sampling
        if not params.greedy:  # the seed its random stream starts from at its first sample (in the backend)
            seq.seed = params.seed if params.seed is not None else random.getrandbits(63)
        refused = None if self.lora is None else self.lora.bind(seq)
        if refused is not None or (request.adapter is not None and self.lora is None):
            self._end_unstarted(command, FinishReason.ERROR, refused or "this server serves no LoRA adapters")
            return
        self.scheduler.add(seq)

    def _abort(self, command: Abort) -> None:
        seq = self.scheduler.live.get(command.handle)
        if seq is None:
            parked = self.compiling.pop(command.handle)
            if parked is not None:
                self._end_unstarted(parked, FinishReason.CANCELLED)
        elif command.keep_generated is None:
            self.finish(seq, FinishReason.CANCELLED)
        else:
            # A new list, not one cut in place: a step in flight (overlap) may still read the old one.
            seq.token_ids = seq.token_ids[: seq.num_prompt + command.keep_generated]
            seq.num_computed = min(seq.num_computed, len(seq.token_ids))
            self.finish(seq, FinishReason.STOP_SEQUENCE)

    def _apply_adapters(self, command: ManageAdapters) -> None:
        """An AdapterService call on the books, answered (AdapterExists, AdaptersBusy, UnknownAdapter: the caller's
        answer too)."""
        try:
            if self.lora is None:
                raise LoraOff()
            command.reply.set_result(self.lora.apply(command.op, command.adapter))
        except Exception as exc:
            command.reply.set_exception(exc)

    def _end_unstarted(self, command: Add, reason: FinishReason, error: str | None = None) -> None:
        request = command.request
        n = len(request.prompt_token_ids)
        self._collected.append(ended_unstarted(command.handle, request.request_id, n, command.arrival, reason, error))

    def _calibrate_speculation(self) -> None:
        """Measure speculation's step cost on this core, once (off when that fails: serve without it)."""
        speculation = self.speculation
        config = self.config
        if speculation is not None and not speculation.calibrate(
            self, config.max_num_seqs, config.max_num_batched_tokens
        ):
            self.speculation = None

    def _measure_pooling_cost(self) -> None:
        """Measure the pooling cap's F on this core, once, where it applies (pooling_cost.py); when that fails, F is
        the step's token budget (pooling then takes the most the share allows: serving never waits on it)."""
        if not self._pooling_cost_due:
            return
        self._pooling_cost_due = False
        budget = self.config.max_num_batched_tokens
        assert self.loaded.pooling is not None
        scheduler, share = self.scheduler, self.scheduler.pooling_share
        start = time.monotonic()
        scheduler.pooling_share = 1.0  # the measured steps' pooled prompt read whole
        try:
            cost = measure_step_cost(self, self.loaded.vocab_size, budget, PoolingParams(self.loaded.pooling.mode))
        except Exception:
            log.exception("measuring a step's costs for --pooling-share failed; --pooling-step-tokens %d", budget)
            scheduler.pooling_step_tokens = budget
            return
        finally:
            scheduler.pooling_share = share
        self.pooling_cost = cost
        scheduler.pooling_step_tokens, scheduler.pooling_chunk_tokens = cost.fixed_tokens, cost.chunk_tokens
        log.info(
            "pooling beside generation: a step's fixed cost F %d tokens, a pooling chunk's M %d more (one token "
            "%.1f ms, %d tokens %.1f ms, one beside %d pooled %.1f ms; measured in %.1f s): beside G streams Embed "
            "inputs get (G + %d) * %.2f tokens a step, in chunks of at least %d",
            cost.fixed_tokens,
            cost.chunk_tokens,
            cost.one_token_ms,
            cost.prompt_tokens,
            cost.prompt_ms,
            POOLED,
            cost.mixed_ms,
            time.monotonic() - start,
            cost.fixed_tokens,
            share / (1.0 - share),
            POOLING_MIN_CHUNK if cost.chunk_tokens else 1,
        )

    def _die(self, reason: str) -> None:
        log.error("engine is dead: %s", reason)
        self.dead_reason = reason
        self._end_all(FinishReason.ERROR, reason)

    def _end_all(self, reason: FinishReason, error: str | None) -> None:
        """End every request the core holds: running, waiting, and waiting for its grammar."""
        self.runner.drop()
        for seq in list(self.scheduler.live.values()):
            self.finish(seq, reason, error=error)
        for command in self.compiling.take_all():
            self._end_unstarted(command, reason, error)


def pooling_limit(loaded: LoadedModel, max_model_len: int, max_num_batched_tokens: int) -> int:
    """The most tokens one pooling input may hold (0: the model serves none): sentence-transformers' max_seq_length
    where the folder sets it, else the context less one; for an encoder, its whole context (all its positions, as
    sentence-transformers reads them: it generates nothing after them) within one step's token budget too (its
    inputs are read whole)."""
    if loaded.pooling is None:
        return 0
    room = max_model_len if loaded.encoder else max_model_len - 1
    limit = min(loaded.pooling.max_seq_length or room, room)
    return min(limit, max_num_batched_tokens) if loaded.encoder else limit


def context_cap(flag: int | None, model: int, sliding_window: int | None) -> int:
    """The context a core serves: the model's, capped by --max-model-len (`flag`) and by the sliding window."""
    cap = min(flag or model, model)
    if sliding_window is not None and sliding_window < cap:
        # The paged attention attends over the whole context: stay where that equals the window's.
        log.warning(
            "context capped at %d tokens by the model's sliding window (the paged attention attends to the "
            "whole context, which equals the window's only up to there)",
            sliding_window,
        )
        return sliding_window
    return cap


class ThreadCore:
    """The `Core` on a thread of this process: `EngineCore` stepping on the thread `start` starts (after warming up on
    the caller's). `engine_core` is the core itself, for the tests and probes that reach into its books."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self._requests: ClientRequests[str] = ClientRequests()  # handle -> request id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def facts(self) -> CoreFacts:
        return self.engine_core.facts

    @property
    def dead_reason(self) -> str | None:
        return self.engine_core.dead_reason

    @property
    def pid(self) -> int | None:
        return None

    @property
    def num_running(self) -> int:
        return self.engine_core.num_running

    @property
    def num_waiting(self) -> int:
        return self._requests.waiting(self.engine_core.num_running)

    def start(self, emit: Emit) -> None:
        """Warm up (one short generation, on this thread), then start the step thread."""
        self.engine_core.warm_up()

        def counted(outputs: list[EngineOutput]) -> None:
            self._requests.end(outputs)
            emit(outputs)

        self._thread = threading.Thread(
            target=self.engine_core.run, args=(self._stop, counted), name="llmserve-engine", daemon=True
        )
        self._thread.start()

    def add(self, request: GenerationRequest, *, after: int | None = None) -> int:
        handle = self._requests.add(request.request_id)
        try:
            self.engine_core.submit(request, after=after, handle=handle)
        except EngineDead:
            self._requests.discard(handle)
            raise
        return handle

    def abort(self, handle: int, keep_generated: int | None = None) -> None:
        self.engine_core.abort(handle, keep_generated)

    def get_session(self, session_id: str) -> Future[SessionInfo | None]:
        return self.engine_core.get_session(session_id)

    def delete_session(self, session_id: str) -> Future[bool]:
        return self.engine_core.delete_session(session_id)

    def manage_adapters(self, op: AdapterOp) -> Future[AdapterAnswer]:
        return self.engine_core.manage_adapters(op)

    def stats(self) -> EngineStats:
        return self._requests.stats(self.engine_core.stats())

    def take_kv_events(self) -> list[KvEvent]:
        return self.engine_core.take_kv_events()

    def stop(self) -> None:
        """End the step loop (see EngineCore.run) and wait for it; a core never started ends on this thread, where
        nobody listens to its outputs."""
        self._stop.set()
        if self._thread is None:
            self.engine_core.run(self._stop, self._requests.end)
            return
        self.engine_core.wake()
        self._thread.join()
