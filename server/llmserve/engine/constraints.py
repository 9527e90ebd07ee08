"""Constraints on the generated text: compiled off the step thread and cached, one matcher per request, and the
per-step token mask.

llguidance does the grammar work (chosen over xgrammar on this machine, benchmarks/probes/constraint_libraries.py:
compile ~1 ms vs ~6 ms, bitmask for 32 rows ~0.9 ms vs ~0.3-1.3 ms, and it refuses the JSON-schema keywords it
cannot enforce where xgrammar ignores them). Three parts:

- `ConstraintCompiler` turns a `ConstraintSpec` into a `Compiled` grammar in a small worker pool, within a time
  bound, behind a bounded LRU cache keyed by the spec (concurrent requests for one spec share one compile).
  Every refusal is `InvalidRequest(spec.field, the library's reason)`.
- `ConstraintState` is one request's matcher: `Compiled.start()` copies the compiled initial state. The step
  thread advances it with each generated token (the prompt never feeds it) and reads whether it is complete.
- `mask_logits` fills the bitmask of every constrained row of a step in one batched call and adds it to the
  logits (0 where allowed, -inf elsewhere); rows without a constraint are not touched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from llmserve.engine.request import ConstraintKind, ConstraintSpec, InvalidRequest

# Fixed JSON layout: ", " and ": " and no other whitespace. Free whitespace lets a model loop on it forever;
# `lenient: False` makes unimplemented schema keywords an error instead of being ignored. Overrides, so that a
# schema's own "x-guidance" cannot turn either off.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
MAX_REASON_CHARS = 300
_COMPILE_WORKERS = 2


class ConstraintState:
    """One request's position in its grammar. Only the step thread touches it once the request is queued."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a generated token; False when the grammar does not allow it (the state is then an error)."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def done(self) -> bool:
        """The text so far is complete and nothing but the end may follow (or the end was accepted)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return _short(self.matcher.get_error())


@dataclass(slots=True, eq=False)
class Compiled:
    """A validated grammar in its initial state; `start()` gives each request its own copy."""

    template: Any  # an llguidance.LLMatcher that is never advanced

    def start(self) -> ConstraintState:
        return ConstraintState(self.template.deep_copy())


@dataclass(slots=True, eq=False)
class ConstraintCompiler:
    """Compiles constraints for one tokenizer, with a bounded LRU cache of results (and of refusals).

    `tokenizer` is the model's transformers tokenizer (a fast one); `vocab_size` the width of the model's
    logits; `eos_ids` the tokens that end an answer where the grammar is complete.
    """

    tokenizer: Any
    vocab_size: int
    eos_ids: Sequence[int]
    cache_size: int = 256
    timeout_s: float = 10.0
    _cache: OrderedDict[ConstraintSpec, concurrent.futures.Future[Compiled]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _lltokenizer: Any = None
    _spellable: frozenset[int] = frozenset()  # the bytes that occur in some token of the vocabulary
    _pool: concurrent.futures.ThreadPoolExecutor | None = None
    compiles: int = 0  # compiles started (cache misses), for tests and the benchmark

    @classmethod
    def for_model(cls, loaded: Any, config: Any) -> ConstraintCompiler | None:
        """The compiler for a LoadedModel under an EngineConfig's bounds; None when the model has no tokenizer."""
        if loaded.tokenizer is None:
            return None
        return cls(
            loaded.tokenizer,
            loaded.vocab_size,
            loaded.eos_token_ids,
            cache_size=config.constraint_cache_size,
            timeout_s=config.constraint_compile_timeout_s,
        )

    async def compile(self, spec: ConstraintSpec) -> Compiled:
        """The compiled form of `spec`, from the cache or from a worker thread; raises InvalidRequest."""
        future = self._future(spec)
        try:
            # shield: a caller that gives up (timeout, cancel) must not cancel a compile others may share.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except TimeoutError:
            raise InvalidRequest(
                spec.field, f"did not compile within {self.timeout_s:g} s (--constraint-compile-timeout)"
            ) from None

    def compile_now(self, spec: ConstraintSpec) -> Compiled:
        """`compile` on the calling thread's terms: wait for the worker (tests, benchmarks)."""
        try:
            return self._future(spec).result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidRequest(
                spec.field, f"did not compile within {self.timeout_s:g} s (--constraint-compile-timeout)"
            ) from None

    def submit(self, spec: ConstraintSpec) -> concurrent.futures.Future[Compiled]:
        """The compile of `spec` as a future (cached, shared, on a worker thread), without a time bound."""
        return self._future(spec)

    def _future(self, spec: ConstraintSpec) -> concurrent.futures.Future[Compiled]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(spec)
                return future
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_WORKERS, "llmserve-constraints")
            future = self._pool.submit(self._build, spec)
            self.compiles += 1
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _build(self, spec: ConstraintSpec) -> Compiled:
        """On a worker thread: the library's grammar for `spec`, checked; InvalidRequest with its reason."""
        grammar = _grammar(spec)
        tokenizer = self._llguidance_tokenizer()
        for i, option in enumerate(spec.choices):
            # The library's mask is only sound for text the vocabulary can spell (SmolLM2's has no token with the
            # byte 0xF1, so nothing in U+40000-U+7FFFF, nor a few control characters).
            missing = set(option.encode("utf-8", "surrogatepass")) - self._spellable
            if missing:
                raise InvalidRequest(
                    spec.field,
                    f"option {i} has characters the model's vocabulary cannot spell (bytes "
                    f"{', '.join(f'0x{b:02x}' for b in sorted(missing))})",
                )
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(spec.field, _short(matcher.get_error()))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error or messages:  # a warning means part of the constraint would not be enforced as written
            raise InvalidRequest(spec.field, _short("; ".join(messages)))
        return Compiled(matcher)

    def _llguidance_tokenizer(self) -> Any:
        with self._lock:  # built once (~0.4 s for SmolLM2's 49,152 tokens), by the first compile
            if self._lltokenizer is None:
                tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_ids)
                )
                spellable: set[int] = set()
                for token in range(tokenizer.vocab_size):
                    spellable.update(tokenizer.decode_bytes([token]))
                self._spellable = frozenset(spellable)
                self._lltokenizer = tokenizer
            return self._lltokenizer

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _grammar(spec: ConstraintSpec) -> str:
    kind = spec.kind
    if kind is ConstraintKind.JSON_SCHEMA or kind is ConstraintKind.JSON_OBJECT:
        text = '{"type": "object"}' if kind is ConstraintKind.JSON_OBJECT else spec.text
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise InvalidRequest(spec.field, f"is not JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequest(spec.field, "is nested too deeply") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(spec.field, "must be a JSON object (a schema)")
        try:
            grammar: str = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequest(spec.field, _short(str(exc))) from None
        return grammar
    if kind is ConstraintKind.REGEX:
        return str(llguidance.LLMatcher.grammar_from_regex(spec.text))
    if kind is ConstraintKind.GRAMMAR:
        return str(llguidance.LLMatcher.grammar_from_lark(spec.text))
    # A choice: one Lark rule of string literals; JSON's string escapes are Lark's.
    return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices)))


def _short(reason: str) -> str:
    """The library's reason without its state dump, cut for a status message."""
    reason = reason.split("\n<state>", 1)[0].strip()
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


# -- the per-step mask -------------------------------------------------------------------------------------

# Byte value -> the additive mask of its 8 tokens (bit i set: token 8k+i allowed -> 0.0, else -inf). Adding a
# float mask gathered per byte beats masked_fill with an unpacked bool mask: 0.6 vs 3.4 ms at [32, 49152] on
# this machine (benchmarks/probes/constraint_libraries.py).
_BYTE_MASK = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))
_byte_masks: dict[torch.device, torch.Tensor] = {}
_executor: Any = None


def _parallel() -> Any:
    global _executor
    if _executor is None:  # one per process; its threads are the library's (it drops the GIL)
        _executor = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
    return _executor


def fill_bitmask(states: Sequence[ConstraintState], vocab_size: int) -> torch.Tensor:
    """The allowed tokens of each state as an int32 CPU bitmask [len(states), ceil(vocab / 32)], one batched call."""
    bitmask = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask_par(_parallel(), [(s.matcher, i) for i, s in enumerate(states)], bitmask)
    return bitmask


def additive_mask(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab_size] float32 on `device`: 0.0 where the bitmask allows the token, -inf elsewhere."""
    table = _byte_masks.get(device)
    if table is None:
        table = _byte_masks[device] = _BYTE_MASK.to(device)
    data = bitmask.to(device, non_blocking=True).view(torch.uint8).view(-1).long()
    return table.index_select(0, data).view(bitmask.shape[0], -1)[:, :vocab_size]


def constraint_masks(states: Sequence[ConstraintState], vocab_size: int, device: torch.device) -> torch.Tensor:
    """The additive masks of a step's constrained rows, in order (see fill_bitmask and additive_mask)."""
    return additive_mask(fill_bitmask(states, vocab_size), vocab_size, device)
