"""The engine's step loop: typed commands in, one step at a time, deltas out.

A step reads as its five parts: drain the inbox (`Add`, `Abort`), schedule (the scheduler's `StepPlan`),
execute (the backend: one forward, the rows that sample), update the books, emit each request's delta. The
step thread owns all engine state; other threads only put commands in the inbox and use the session methods,
which take the book-keeping lock.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.base import BlockCopier
from llmserve.engine.block_pool import BlockPool
from llmserve.engine.config import EngineConfig
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.kv_tiers.worker import build_tiers
from llmserve.engine.plan import StepPlan
from llmserve.engine.protocol import EngineStats, SessionInfo
from llmserve.engine.request import (
    Delta,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    SeqStatus,
    Sequence,
    Timing,
    TokenLogprob,
    Usage,
)
from llmserve.engine.sampler import RowFailed, Sampled
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sessions import SessionStore
from llmserve.models import LoadedModel

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 3


@dataclass(slots=True, frozen=True)
class Add:
    """Start serving `request`; its deltas go to `deliver` (called on the step thread)."""

    handle: int
    request: GenerationRequest
    deliver: Callable[[Delta], None]
    arrival: float  # time.monotonic()


@dataclass(slots=True, frozen=True)
class Abort:
    """Stop the request `submit` returned `handle` for; its final delta says CANCELLED."""

    handle: int


Command = Add | Abort


@dataclass(slots=True, eq=False)
class _Live:
    """A request inside the engine: its sequence, detokenizer and where its deltas go."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    deliver: Callable[[Delta], None]


def sliding_window(config: object) -> int | None:
    """The attention window a model config enables, if any (Mistral; Qwen2 with use_sliding_window)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not window or not getattr(text, "use_sliding_window", True):
        return None
    return int(window)


class EngineCore:
    """Owns scheduler, sessions, block pool and backend; `step()` is one iteration. Not thread-safe itself:
    the step thread calls step(); others only use submit(), abort() and the session methods."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer: Any = loaded.tokenizer  # a transformers tokenizer (its decode returns str here)
        self.max_model_len = min(config.max_model_len or loaded.context_length, loaded.context_length)
        self.sliding_window = sliding_window(loaded.model.config)
        if self.sliding_window is not None and self.sliding_window < self.max_model_len:
            # The paged attention attends over the whole context: stay where that equals the window's.
            log.warning(
                "context capped at %d tokens by the model's sliding window (the paged attention attends to the "
                "whole context, which equals the window's only up to there)",
                self.sliding_window,
            )
            self.max_model_len = self.sliding_window
        self.backend = create_backend(loaded, config, self.max_model_len)
        # Lower KV tiers (--kv-offload-*): raises ValueError naming the flag when they cannot be had.
        self.tiers = build_tiers(config, loaded, BlockCopier(self.backend.kv))
        self.pool = BlockPool(self.backend.num_blocks, config.block_size, track_evictions=self.tiers is not None)
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
            enable_prefix_caching=config.enable_prefix_caching,
            tiers=self.tiers,
        )
        if self.tiers is not None:
            self.tiers.start()
        self.lock = threading.Lock()  # guards scheduler/sessions/pool against the front end's session calls
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles = itertools.count(1)  # also each sequence's arrival order (seq_no)
        self._live: dict[int, _Live] = {}
        self._submitted = 0
        self._drained = 0
        self._failures = 0
        self.dead_reason: str | None = None
        self.steps = 0
        # Called on the step thread after every pass of the loop that may have delivered deltas: a front end
        # that buffers its deliveries hands them on here, once per step instead of once per delta.
        self.flush: Callable[[], None] = lambda: None

    # -- called from any thread ------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        request.validate(self.loaded.vocab_size, self.max_model_len)
        total = len(request.prompt_token_ids) + request.stopping.max_new_tokens
        if self.pool.blocks_for(total) > self.pool.num_blocks:
            raise InvalidRequest(
                "max_new_tokens",
                f"prompt + max_new_tokens = {total} tokens never fits the KV pool "
                f"({self.pool.num_blocks * self.pool.block_size} tokens)",
            )

    def submit(self, request: GenerationRequest, deliver: Callable[[Delta], None]) -> int:
        """Queue a validated request; `deliver` is called (on the step thread) with each delta. Returns the
        handle that `abort` takes."""
        handle = next(self._handles)
        self._submitted += 1  # written by the submitting thread only; _drained by the step thread only
        self._inbox.put(Add(handle, request, deliver, time.monotonic()))
        self._wake.set()
        return handle

    def abort(self, handle: int) -> None:
        self._inbox.put(Abort(handle))
        self._wake.set()

    def wake(self) -> None:
        """Make an idle step loop look at its inbox and stop flag now."""
        self._wake.set()

    def run_until(self, done: threading.Event) -> None:
        """Step on the calling thread until `done` is set (the warm-up, before the step thread starts)."""
        while not done.is_set():
            self._drain_inbox()
            self.step()
            self.flush()

    def get_session(self, session_id: str) -> SessionInfo | None:
        with self.lock:
            self.sessions.expire()
            session = self.sessions.get(session_id)
            if session is not None:
                return SessionInfo(session_id, len(session.token_ids), session.last_used_wall)
            departed = self.sessions.departed.get(session_id)
            if departed is None or self.tiers is None:
                return None
            in_pool, in_tiers = self.tiers.where(departed[0], self.pool)
            return SessionInfo(session_id, in_pool, departed[1], in_tiers) if in_pool or in_tiers else None

    def delete_session(self, session_id: str) -> bool:
        with self.lock:
            return self.sessions.delete(session_id)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def stats(self) -> EngineStats:
        """Read without the lock (plain ints, each read atomically): a scrape never stalls a step."""
        pool, sessions, scheduler = self.pool, self.sessions, self.scheduler
        free = pool.num_free
        return EngineStats(
            running=self.num_running,
            waiting=self.num_waiting,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_blocks - free,
            kv_blocks_cached=pool.num_cached,
            block_size=pool.block_size,
            sessions=len(sessions),
            session_blocks=sessions.num_blocks_held,
            preemptions=scheduler.num_preemptions,
            session_hits=scheduler.num_session_hits,
            session_misses=scheduler.num_session_misses,
            session_evictions=dict(sessions.evictions),
            prefix_cache_hits=scheduler.num_prefix_cache_hits,
            kv_tiers=self.tiers.stats() if self.tiers is not None else None,
        )

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running (still in the inbox or in the scheduler's queue)."""
        return self.scheduler.num_waiting + self._submitted - self._drained

    # -- the step thread -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set; then cancel whatever is left."""
        while not stop.is_set():
            self._drain_inbox()
            self.flush()  # the final deltas of aborted requests, at once (a no-op when there are none)
            if not self.scheduler.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # a fault in the books, not in a forward: fail every request, never hang them
                log.exception("engine step failed")
                self._die(f"engine step failed: {type(exc).__name__}: {exc}")
            self.flush()
        self._drain_inbox()
        with self.lock:
            for live in list(self._live.values()):
                self._finish(live, FinishReason.CANCELLED)
        self.flush()
        self.close_tiers()

    def close_tiers(self) -> None:
        """Write every hashed block still in the pool to the tiers and finish their writes (at shutdown: a
        restarted server finds the conversations on disk). Idempotent."""
        if self.tiers is not None:
            with self.lock:
                self.tiers.write_back(self.pool)
            self.tiers.close()

    def step(self) -> None:
        """One iteration: schedule, execute, update, emit."""
        now = time.monotonic()
        with self.lock:
            self._expire_deadlines(now)
            if self.tiers is not None:
                self.tiers.finish_loads(self.scheduler.load_done)
            plan = self.scheduler.schedule()
            if self.tiers is not None:
                # Before the forward, which may overwrite the evicted blocks: copy them out, start the loads.
                self.tiers.offload(plan.offloads)
                for block, content in plan.loads:
                    self.tiers.load(block, content)
        if not plan.seqs:
            if self.tiers is not None and self.tiers.in_flight:
                self.tiers.wait(0.05)  # only loads to wait for: sleep until one ends rather than spin
            return
        for entry in plan.seqs:
            if entry.seq.first_scheduled is None:
                entry.seq.first_scheduled = now
        try:
            results = self.backend.execute(plan)
        except Exception as exc:  # a bad batch must not take the server down
            self._fail_step(plan, exc)
            return
        self._failures = 0
        self.steps += 1
        emit_time = time.monotonic()
        with self.lock:
            self.scheduler.update(plan)
            for entry, result in zip(plan.sampling, results, strict=True):
                self._emit(self._live[entry.seq.seq_no], result, emit_time)

    # -- internals -------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                self._drained += 1
                self._add(command)
            else:
                live = self._live.get(command.handle)
                if live is not None:
                    with self.lock:
                        self._finish(live, FinishReason.CANCELLED)

    def _add(self, command: Add) -> None:
        request = command.request
        if self.dead_reason is not None:
            n = len(request.prompt_token_ids)
            final = Delta(request.request_id, [], finish_reason=FinishReason.ERROR, usage=Usage(n, 0, 0))
            final.error = self.dead_reason
            command.deliver(final)
            return
        stopping = request.stopping
        seq = Sequence(
            request,
            list(request.prompt_token_ids),
            command.arrival,
            command.handle,
            stop_ids=frozenset(stopping.stop_token_ids),
            eos_ids=frozenset() if stopping.ignore_eos else frozenset(self.loaded.eos_token_ids),
        )
        params = request.sampling
        if not params.greedy:
            seq.seed = params.seed if params.seed is not None else random.getrandbits(63)
            seq.generator = torch.Generator(device=self.backend.device).manual_seed(seq.seed)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, stopping.stop_sequences, stopping.include_stop_sequence)
        self._live[command.handle] = _Live(seq, detok, command.deliver)
        with self.lock:
            self.scheduler.add(seq)

    def _emit(self, live: _Live, result: Sampled | RowFailed, now: float) -> None:
        """Hand a sampled token to its request; a failure here is that request's alone."""
        if isinstance(result, RowFailed):
            self._finish(live, FinishReason.ERROR, error=result.error)
            return
        try:
            self._append(live, result.token_id, result.logprob, now)
        except Exception as exc:  # its stop strings or detokenizer
            log.exception("request %r failed after its forward", live.seq.request_id)
            if live.seq.status is not SeqStatus.FINISHED:
                self._finish(live, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _append(self, live: _Live, token_id: int, lp: TokenLogprob | None, now: float) -> None:
        seq = live.seq
        stopping = seq.request.stopping
        seq.token_ids.append(token_id)
        if seq.first_token is None:
            seq.first_token = now
        text = ""
        reason = None
        if token_id in seq.stop_ids:
            reason = FinishReason.STOP_TOKEN
        elif token_id in seq.eos_ids:
            reason = FinishReason.EOS
        if live.detok is not None:
            pushed = live.detok.push([token_id])
            text = pushed.text
            if reason is None and pushed.stop_sequence is not None:
                reason = FinishReason.STOP_SEQUENCE
        if reason is None and (
            seq.num_generated >= stopping.max_new_tokens or len(seq.token_ids) >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        delta = Delta(seq.request_id, [token_id], text, [lp] if lp is not None else None)
        if reason is None:
            live.deliver(delta)
            return
        if live.detok is not None and reason is not FinishReason.STOP_SEQUENCE:
            delta.text += live.detok.flush()
            if live.detok.stopped_on is not None:  # the held-back tail completed a stop string
                reason = FinishReason.STOP_SEQUENCE
        self._finish(live, reason, delta=delta)

    def _fail_step(self, plan: StepPlan, exc: Exception) -> None:
        """The shared forward raised: every request in it fails, and none of their KV may be reused."""
        log.error("forward failed for %d requests", len(plan.seqs), exc_info=exc)
        error = f"{type(exc).__name__}: {exc}"
        self._failures += 1
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            # Set before the batch hears of its failure, so that callers see a dead engine at once.
            self.dead_reason = f"{MAX_CONSECUTIVE_FAILURES} consecutive failed steps, last: {error}"
        with self.lock:
            self.scheduler.abandon(plan)
            for entry in plan.seqs:
                live = self._live.get(entry.seq.seq_no)
                if live is not None:
                    self._finish(live, FinishReason.ERROR, error=error)
        if self.dead_reason is not None:
            self._die(self.dead_reason)

    def _finish(
        self, live: _Live, reason: FinishReason, *, delta: Delta | None = None, error: str | None = None
    ) -> None:
        """Retire a live request (caller holds the lock) and deliver its final delta."""
        seq = live.seq
        self.scheduler.finish(seq, reason)
        del self._live[seq.seq_no]
        if delta is None:
            delta = Delta(seq.request_id, [])
        now = time.monotonic()
        delta.finish_reason = reason
        delta.error = error
        delta.seed = seq.seed
        delta.usage = Usage(seq.num_prompt, seq.num_cached_prompt, seq.num_generated)
        started = seq.first_scheduled if seq.first_scheduled is not None else now
        first = seq.first_token if seq.first_token is not None else now
        delta.timing = Timing(started - seq.arrival, first - seq.arrival, now - seq.arrival)
        live.deliver(delta)

    def _expire_deadlines(self, now: float) -> None:
        for live in [lv for lv in self._live.values() if lv.seq.request.deadline is not None]:
            deadline = live.seq.request.deadline
            if deadline is not None and deadline <= now:
                self._finish(live, FinishReason.DEADLINE)

    def _die(self, reason: str) -> None:
        log.error("engine is dead: %s", reason)
        self.dead_reason = reason
        with self.lock:
            for live in list(self._live.values()):
                self._finish(live, FinishReason.ERROR, error=reason)
