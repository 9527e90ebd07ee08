"""The engine: a step loop on its own thread, and the asyncio front end that feeds it.

The loop only steps: drain commands (add / abort), `schedule()`, one forward, sample, then
`update`, stop checks and detokenization, and one hand-off of all the step's deltas to the event loop.
The front end never touches engine state except through the command queue and the book-keeping lock.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from llmserve.engine.block_pool import BlockPool
from llmserve.engine.config import EngineConfig
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.request import (
    Delta,
    EngineDead,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    QueueFull,
    SeqStatus,
    Sequence,
    StoppingParams,
    Timing,
    Usage,
)
from llmserve.engine.runner import KVShape, ModelRunner
from llmserve.engine.sampler import SampleRow, sample
from llmserve.engine.scheduler import Scheduler, SchedulerOutput
from llmserve.engine.sessions import SessionStore
from llmserve.models import LoadedModel

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 3


@dataclass(slots=True)
class ModelInfo:
    name: str
    context_length: int
    max_new_tokens: int
    dtype: str
    device: str
    vocab_size: int


@dataclass(slots=True)
class SessionInfo:
    session_id: str
    cached_tokens: int
    last_used: float  # unix time


@dataclass(slots=True, eq=False)
class _Live:
    """A request inside the engine: its sequence, detokenizer and where its deltas go."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    deliver: Callable[[Delta], None]
    stop_ids: frozenset[int]
    eos_ids: frozenset[int]


def sliding_window(config: object) -> int | None:
    """The attention window a model config enables, if any (Mistral; Qwen2 with use_sliding_window)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not window or not getattr(text, "use_sliding_window", True):
        return None
    return int(window)


def size_pool(config: EngineConfig, shape: KVShape, dtype: torch.dtype, device: torch.device) -> int:
    """Number of KV blocks: from a token count, or a fraction of free memory."""
    per_block = shape.bytes_per_token(dtype) * config.block_size
    if config.kv_cache_tokens is not None:
        return max(1, -(-config.kv_cache_tokens // config.block_size))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.kv_cache_memory_fraction
    else:
        budget = config.cpu_kv_cache_bytes * config.kv_cache_memory_fraction
    return max(1, int(budget // per_block))


class EngineCore:
    """Owns scheduler, sessions, block pool and runner; `step()` is one iteration. Not thread-safe itself:
    the step thread calls step(); others only use submit(), abort() and the session methods."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.context_length, loaded.context_length)
        window = sliding_window(loaded.model.config)
        if window is not None:
            # The paged attention attends over the whole context: stay where that equals the window's.
            self.max_model_len = min(self.max_model_len, window)
        shape = KVShape.of(loaded.model.config)
        num_blocks = size_pool(config, shape, loaded.dtype, loaded.device)
        self.pool = BlockPool(num_blocks, config.block_size)
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
        )
        self.runner = ModelRunner(
            loaded.model,
            num_blocks,
            config.block_size,
            cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            native_decode=config.native_attention,
            pack_linears=config.packed_linear,
            fused_layers=config.fused_layers,
        )
        self.lock = threading.Lock()  # guards scheduler/sessions/pool against the front end's session calls
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}
        self._seq_no = 0
        self._submitted = 0
        self._drained = 0
        self._failures = 0
        self.dead_reason: str | None = None
        self.steps = 0

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

    def submit(self, request: GenerationRequest, deliver: Callable[[Delta], None]) -> None:
        """Queue a validated request; `deliver` is called (on the step thread) with each delta."""
        self._submitted += 1  # written by the submitting thread only; _drained by the step thread only
        self._inbox.put(("add", (request, deliver, time.monotonic())))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def wake(self) -> None:
        """Make an idle step loop look at its inbox and stop flag now."""
        self._wake.set()

    def run_until(self, done: threading.Event) -> None:
        """Step on the calling thread until `done` is set (the warm-up, before the step thread starts)."""
        while not done.is_set():
            self._drain_inbox()
            self.step()

    def get_session(self, session_id: str) -> SessionInfo | None:
        with self.lock:
            self.sessions.expire()
            session = self.sessions.get(session_id)
            if session is None:
                return None
            return SessionInfo(session_id, len(session.token_ids), session.last_used_wall)

    def delete_session(self, session_id: str) -> bool:
        with self.lock:
            return self.sessions.delete(session_id)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running (still in the inbox or in the scheduler's queue)."""
        return self.scheduler.num_waiting + self._submitted - self._drained

    # -- the step thread -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set; then cancel whatever is left."""
        while not stop.is_set():
            self._drain_inbox()
            if not self.scheduler.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self.step()
        self._drain_inbox()
        with self.lock:
            for live in list(self._live.values()):
                self._finish(live, FinishReason.CANCELLED)

    def step(self) -> None:
        """One iteration: schedule, forward, sample, update, emit."""
        now = time.monotonic()
        with self.lock:
            self._expire_deadlines(now)
            out = self.scheduler.schedule()
        if not out.scheduled:
            self.scheduler.update(out)
            return
        # One-token queries first, shortest context first: the runner batches them by length.
        out.scheduled.sort(key=lambda item: (item[1] != 1, item[0].num_computed))
        to_sample = [seq for seq, n in out.scheduled if seq.num_computed + n == len(seq.token_ids)]
        for seq, _ in out.scheduled:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        try:
            self.runner.copy_blocks(out.copies)
            logits = self.runner.execute(out.scheduled, to_sample)
        except Exception as exc:  # a bad batch must not take the server down
            self._fail_step(out, exc)
            return
        self._failures = 0
        self.steps += 1
        picked = self._sample(logits, to_sample)
        emit_time = time.monotonic()
        with self.lock:
            self.scheduler.update(out)
            for seq, result in zip(to_sample, picked, strict=True):
                live = self._live[seq.request_id]
                if isinstance(result, str):
                    self._finish(live, FinishReason.ERROR, error=result)
                    continue
                try:
                    self._append(live, *result, emit_time)
                except Exception as exc:  # its stop strings or detokenizer: this request's failure alone
                    log.exception("request %r failed after its forward", seq.request_id)
                    if seq.status is not SeqStatus.FINISHED:
                        self._finish(live, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, object] | str]:
        """Per sequence its (token id, logprob), or the error that failed its sampling alone.

        The whole batch is sampled at once; should that raise, each row is sampled on its own, so that a row's
        failure (its parameters, its penalties) fails its request only and the others keep their tokens.
        """
        rows = [self._sample_row(seq) for seq in seqs]
        try:
            token_ids, logprobs = sample(logits, rows)
            return list(zip(token_ids, logprobs, strict=True))
        except Exception:
            log.exception("batched sampling failed: sampling %d rows one by one", len(rows))
        results: list[tuple[int, object] | str] = []
        for i, row in enumerate(rows):
            try:
                ids, lps = sample(logits[i : i + 1], [row])
                results.append((ids[0], lps[0]))
            except Exception as exc:
                results.append(f"sampling failed: {type(exc).__name__}: {exc}")
        return results

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> None:
        """The shared forward raised: every request in it fails, and none of their KV may be reused."""
        log.exception("forward failed for %d requests", len(out.scheduled), exc_info=exc)
        error = f"{type(exc).__name__}: {exc}"
        self._failures += 1
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            # Set before the batch hears of its failure, so that callers see a dead engine at once.
            self.dead_reason = f"{MAX_CONSECUTIVE_FAILURES} consecutive failed steps, last: {error}"
        with self.lock:
            self.scheduler.abandon(out)
            for seq, _ in out.scheduled:
                live = self._live.get(seq.request_id)
                if live is not None:
                    self._finish(live, FinishReason.ERROR, error=error)
        if self.dead_reason is not None:
            self._die(self.dead_reason)

    # -- internals -------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._drained += 1
                request, deliver, arrival = payload
                self._add(request, deliver, arrival)
            elif kind == "abort":
                live = self._live.get(payload)
                if live is not None:
                    with self.lock:
                        self._finish(live, FinishReason.CANCELLED)

    def _add(self, request: GenerationRequest, deliver: Callable[[Delta], None], arrival: float) -> None:
        if self.dead_reason is not None:
            deliver(self._final_delta_for(request, FinishReason.ERROR, self.dead_reason))
            return
        if request.request_id in self._live:
            deliver(self._final_delta_for(request, FinishReason.ERROR, "duplicate request_id in flight"))
            return
        self._seq_no += 1
        seq = Sequence(request, list(request.prompt_token_ids), arrival, self._seq_no)
        params = request.sampling
        if not params.greedy:
            seq.seed = params.seed if params.seed is not None else random.getrandbits(63)
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(seq.seed)
        stopping = request.stopping
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, stopping.stop_sequences, stopping.include_stop_sequence)
        eos = frozenset() if stopping.ignore_eos else frozenset(self.loaded.eos_token_ids)
        self._live[request.request_id] = _Live(seq, detok, deliver, frozenset(stopping.stop_token_ids), eos)
        with self.lock:
            self.scheduler.add(seq)

    def _sample_row(self, seq: Sequence) -> SampleRow:
        live = self._live[seq.request_id]
        request = seq.request
        blocked: frozenset[int] | tuple[()] = ()
        if seq.num_generated < request.stopping.min_new_tokens:
            blocked = live.stop_ids | live.eos_ids
        return SampleRow(
            params=request.sampling,
            generator=seq.generator,
            token_ids=seq.token_ids,
            blocked_token_ids=tuple(blocked),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
        )

    def _append(self, live: _Live, token_id: int, lp: object, now: float) -> None:
        seq = live.seq
        stopping = seq.request.stopping
        seq.token_ids.append(token_id)
        if seq.first_token is None:
            seq.first_token = now
        text = ""
        reason = None
        if token_id in live.stop_ids:
            reason = FinishReason.STOP_TOKEN
        elif token_id in live.eos_ids:
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

    def _finish(
        self, live: _Live, reason: FinishReason, *, delta: Delta | None = None, error: str | None = None
    ) -> None:
        """Retire a live request (caller holds the lock) and deliver its final delta."""
        seq = live.seq
        self.scheduler.finish(seq, reason)
        del self._live[seq.request_id]
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

    def _final_delta_for(self, request: GenerationRequest, reason: FinishReason, error: str) -> Delta:
        n = len(request.prompt_token_ids)
        return Delta(request.request_id, [], finish_reason=reason, usage=Usage(n, 0, 0), error=error)

    def _expire_deadlines(self, now: float) -> None:
        for live in [lv for lv in self._live.values() if lv.seq.request.deadline is not None]:
            if live.seq.request.deadline <= now:
                self._finish(live, FinishReason.DEADLINE)

    def _die(self, reason: str) -> None:
        log.error("engine is dead: %s", reason)
        self.dead_reason = reason
        with self.lock:
            for live in list(self._live.values()):
                self._finish(live, FinishReason.ERROR, error=reason)


class AsyncEngine:
    """The asyncio front end: `generate()` streams deltas; the step loop runs on its own thread."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.core = EngineCore(loaded, config)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = 0

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer, or None for random-weight models
        return self.loaded.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        core = self.core
        return ModelInfo(
            name=self.loaded.name,
            context_length=core.max_model_len,
            max_new_tokens=core.max_model_len - 1,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            device=str(self.loaded.device),
            vocab_size=self.loaded.vocab_size,
        )

    @property
    def dead(self) -> bool:
        return self.core.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self.core.dead_reason

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    async def start(self) -> None:
        """Warm up (one short generation, off the event loop), then start the step thread."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._warm_up)
        self._thread = threading.Thread(target=self.core.run, args=(self._stop,), name="llmserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the step thread; requests still running end with CANCELLED."""
        self._stop.set()
        self.core.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def get_session(self, session_id: str) -> SessionInfo | None:
        return self.core.get_session(session_id)

    def delete_session(self, session_id: str) -> bool:
        return self.core.delete_session(session_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream the request's deltas. Raises InvalidRequest, EngineDead or QueueFull before the first one.

        Closing or cancelling the consumer aborts the request in the engine.
        """
        if self.dead:
            raise EngineDead(self.dead_reason)
        self.core.validate(request)
        if self.core.num_waiting >= self.config.max_waiting:
            raise QueueFull(f"{self.core.num_waiting} requests waiting")
        loop = self._loop or asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()

        def deliver(delta: Delta) -> None:
            try:
                loop.call_soon_threadsafe(deltas.put_nowait, delta)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        self.core.submit(request, deliver)
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.core.abort(request.request_id)

    def _warm_up(self) -> None:
        request = GenerationRequest("warm-up", (0,) * 8, stopping=StoppingParams(max_new_tokens=2, ignore_eos=True))
        done = threading.Event()
        self.core.submit(request, lambda d: d.finished and done.set())
        self.core.run_until(done)
