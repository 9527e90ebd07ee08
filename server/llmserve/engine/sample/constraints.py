"""Constraints on the generated text, on llguidance: the front end's check, the engine's compile, and one request's
grammar state. Nothing here imports torch; the per-step masks are the sampler's (masks.py).

llguidance does the grammar work (chosen over xgrammar on this machine, benchmarks/probes/constraint_libraries.py:
compile ~1 ms vs ~6 ms, bitmask for 32 rows ~0.9 ms vs ~0.3-1.3 ms, and it refuses the JSON-schema keywords it
cannot enforce where xgrammar ignores them). The parts:

- `ConstraintChecker`, the front end's: whether a spec can be served, before the request is queued, so that a bad
  one is `InvalidRequest(spec.field, the library's reason)`. It builds the grammar and has the library validate it
  (no tokenizer needed: on the test suite's refusals and schema corpus that refuses exactly what building a
  matcher refuses, at half its cost), and checks that a choice is spellable. It keeps no matcher.
- `ConstraintCompiler`, the engine core's: the matcher of a checked spec (`Compiled`); `Compiled.start()` gives each
  request its own `ConstraintState`, which the step thread alone advances (sequence.GrammarState).
- `Vocabulary`: the model's vocabulary as the library sees it, built on first use (~0.4 s for SmolLM2's 49,152
  tokens), once per process: the core on a thread shares its front end's.

Checker and compiler run their work on a small pool of worker threads (the library drops the GIL), behind a
bounded LRU cache keyed by the spec (concurrent requests for one spec share one future; refusals are cached too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import llguidance

from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.request import ConstraintKind, ConstraintSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from llmserve.engine.config import EngineConfig
    from llmserve.engine.types.model import LoadedModel, ModelCard

# Fixed JSON layout: ", " and ": " and no other whitespace. Free whitespace lets a model loop on it forever;
# `lenient: False` makes unimplemented schema keywords an error instead of being ignored. Overrides, so that a
# schema's own "x-guidance" cannot turn either off.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
MAX_REASON_CHARS = 300
_WORKERS = 2
T = TypeVar("T")


class Vocabulary:
    """The model's tokenizer as llguidance takes it, and the bytes its tokens spell; built on first use."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._source = tokenizer
        self.vocab_size = vocab_size  # the width of the model's logits
        self._eos_ids = list(eos_ids)  # the tokens that end an answer where the grammar is complete
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._spellable: frozenset[int] = frozenset()

    @classmethod
    def for_model(cls, loaded: LoadedModel | ModelCard) -> Vocabulary | None:
        """The vocabulary of a model (or its card); None when it has no tokenizer (then no constraint can be
        served)."""
        if loaded.tokenizer is None:
            return None
        return cls(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        self._build()
        assert self._tokenizer is not None
        return self._tokenizer

    @property
    def spellable(self) -> frozenset[int]:
        """The byte values that occur in some token."""
        self._build()
        return self._spellable

    def _build(self) -> None:
        with self._lock:
            if self._tokenizer is not None:
                return
            import llguidance.hf  # imports transformers: only where a tokenizer exists anyway

            fast = cast("PreTrainedTokenizerFast", self._source)  # the library reads a fast tokenizer's vocabulary
            tokenizer = llguidance.hf.from_tokenizer(fast, n_vocab=self.vocab_size, eos_token=self._eos_ids)
            spellable: set[int] = set()
            for token in range(tokenizer.vocab_size):
                spellable.update(tokenizer.decode_bytes([token]))
            self._spellable = frozenset(spellable)
            self._tokenizer = tokenizer


class SpecCache(Generic[T]):
    """`build(spec)` on a worker thread, its future kept in an LRU cache of `size` specs (a refusal too)."""

    def __init__(self, build: Callable[[ConstraintSpec], T], size: int, name: str) -> None:
        self._build = build
        self._size = size
        self._name = name
        self._cache: OrderedDict[ConstraintSpec, concurrent.futures.Future[T]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.builds = 0  # cache misses: for the tests and the benchmarks

    def get(self, spec: ConstraintSpec) -> concurrent.futures.Future[T]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(spec)
                return future
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(_WORKERS, self._name)
            future = self._pool.submit(self._build, spec)
            self.builds += 1
            self._cache[spec] = future
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
            return future

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class ConstraintChecker:
    """The front end's check of a constraint (see the module docstring); one per front end."""

    def __init__(self, vocabulary: Vocabulary, *, cache_size: int = 256, timeout_s: float = 10.0) -> None:
        self.vocabulary = vocabulary
        self.timeout_s = timeout_s
        self.cache = SpecCache(self._check, cache_size, "llmserve-constraint-checks")

    @classmethod
    def for_model(cls, loaded: LoadedModel | ModelCard, config: EngineConfig) -> ConstraintChecker | None:
        vocabulary = Vocabulary.for_model(loaded)
        return None if vocabulary is None else cls.over(vocabulary, config)

    @classmethod
    def over(cls, vocabulary: Vocabulary, config: EngineConfig) -> ConstraintChecker:
        """The checker over `vocabulary` under an EngineConfig's bounds."""
        return cls(vocabulary, cache_size=config.constraint_cache_size, timeout_s=config.constraint_compile_timeout_s)

    async def check(self, spec: ConstraintSpec) -> None:
        """Return when `spec` can be served; raise InvalidRequest naming its field otherwise, or when the check
        takes longer than `timeout_s`."""
        try:
            # shield: a caller that gives up (timeout, cancel) must not cancel a check others may share.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.cache.get(spec))), self.timeout_s)
        except TimeoutError:
            raise InvalidRequest(
                spec.field, f"did not compile within {self.timeout_s:g} s (--constraint-compile-timeout)"
            ) from None

    def _check(self, spec: ConstraintSpec) -> None:
        """On a worker thread: raise InvalidRequest with the library's reason when `spec` cannot be enforced."""
        grammar = grammar_text(spec)
        if spec.choices:
            spellable = self.vocabulary.spellable
            for i, option in enumerate(spec.choices):
                # The library's mask is only sound for text the vocabulary can spell (SmolLM2's has no token with
                # the byte 0xF1, so nothing in U+40000-U+7FFFF, nor a few control characters).
                missing = set(option.encode("utf-8", "surrogatepass")) - spellable
                if missing:
                    raise InvalidRequest(
                        spec.field,
                        f"option {i} has characters the model's vocabulary cannot spell (bytes "
                        f"{', '.join(f'0x{b:02x}' for b in sorted(missing))})",
                    )
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error or messages:  # a warning means part of the constraint would not be enforced as written
            raise InvalidRequest(spec.field, _short("; ".join(messages)))

    def close(self) -> None:
        self.cache.close()


class ConstraintState:
    """One request's position in its grammar. Only the step thread touches it once the request is queued."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
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


class Compiled:
    """A grammar's matcher in its initial state, never advanced; `start()` gives each request its own copy."""

    __slots__ = ("template",)

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self.template = template

    def start(self) -> ConstraintState:
        return ConstraintState(self.template.deep_copy())


class ConstraintCompiler:
    """The engine core's compiler: the matcher of each (checked) spec, cached; one per core."""

    def __init__(self, vocabulary: Vocabulary, cache_size: int = 256) -> None:
        self.vocabulary = vocabulary
        self.cache = SpecCache(self._compile, cache_size, "llmserve-constraints")

    def submit(self, spec: ConstraintSpec) -> concurrent.futures.Future[Compiled]:
        """The compile of `spec` (cached, shared, on a worker thread); it raises InvalidRequest for a spec that
        the checker would have refused."""
        return self.cache.get(spec)

    def _compile(self, spec: ConstraintSpec) -> Compiled:
        matcher = llguidance.LLMatcher(self.vocabulary.tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(spec.field, _short(matcher.get_error()))
        return Compiled(matcher)

    def close(self) -> None:
        self.cache.close()


def grammar_text(spec: ConstraintSpec) -> str:
    """The library's grammar for `spec`; InvalidRequest when its text is not even well formed."""
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
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequest(spec.field, _short(str(exc))) from None
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if kind is ConstraintKind.GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    # A choice: one Lark rule of string literals; JSON's string escapes are Lark's.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))


def _short(reason: str) -> str:
    """The library's reason without its state dump, cut for a status message."""
    reason = reason.split("\n<state>", 1)[0].strip()
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."
