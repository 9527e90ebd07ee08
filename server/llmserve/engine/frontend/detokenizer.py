"""Incremental detokenization with stop strings, one instance per request.

Text is decoded over a short sliding window of ids (HF text-generation-inference's prefix/read offsets),
not the whole generation, so a step costs the same at token 10 and token 10,000. The window starts one
emitted chunk back, so decoders that treat the first token specially (SentencePiece's leading space)
decode the new tokens exactly as they would inside the full text.

Text is held back while it may still change: a trailing U+FFFD (an incomplete UTF-8 character; the next
token completes it), a run of SentencePiece byte-fallback tokens that is still open (its decoder renders
the whole run as U+FFFDs if any byte turns out invalid, rewriting characters already decoded), and, with
stop sequences, a tail that could still grow into one.
"""

from __future__ import annotations

import random
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Decoder(Protocol):
    """The one tokenizer method this module needs (a transformers tokenizer has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(slots=True, frozen=True)
class _TokenizerFacts:
    byte_ids: frozenset[int]  # SentencePiece byte-fallback tokens, "<0x00>".."<0xFF>"
    special_ids: frozenset[int]
    decode: Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text, as tokenizer.decode


# Ids per probe of a backend decode against tokenizer.decode, and probes (random runs of the vocabulary, the
# special tokens among them).
_PROBE_IDS, _PROBES = 8, 64


def _fast_decode(tokenizer: object, vocab_size: int, special_ids: frozenset[int]) -> Callable[[list[int], bool], str]:
    """The Rust tokenizer's own decode where it gives what `tokenizer.decode` gives (a transformers fast tokenizer
    without clean-up adds only Python layers around it: 3.8 us a call against 0.9 us, two calls per token), else
    `tokenizer.decode`. Checked once per tokenizer on random runs of ids, specials included, both ways of
    skipping specials."""

    def slow(ids: list[int], skip: bool) -> str:
        text: str = tokenizer.decode(ids, skip_special_tokens=skip)  # type: ignore[attr-defined]
        return text

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) or vocab_size == 0:
        return slow

    def fast(ids: list[int], skip: bool) -> str:
        text: str = backend.decode(ids, skip_special_tokens=skip)
        return text

    rng = random.Random(0)
    pool = sorted(special_ids)
    for _ in range(_PROBES):
        ids = [rng.randrange(vocab_size) for _ in range(_PROBE_IDS)]
        if pool:
            ids[rng.randrange(_PROBE_IDS)] = rng.choice(pool)
        try:
            if any(fast(ids, skip) != slow(ids, skip) for skip in (True, False)):
                return slow
        except Exception:  # an id the backend does not know: stay on the tokenizer's own path
            return slow
    return fast


# Scanning a vocabulary costs milliseconds, too much per request; tokenizers live as long as the server.
_facts_cache: weakref.WeakKeyDictionary[object, _TokenizerFacts] = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer: object) -> _TokenizerFacts:
    try:
        return _facts_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab: dict[str, int] = get_vocab() if callable(get_vocab) else {}
    special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
    facts = _TokenizerFacts(
        byte_ids=frozenset(i for token, i in vocab.items() if len(token) == 6 and _BYTE_TOKEN.fullmatch(token)),
        special_ids=special_ids,
        decode=_fast_decode(tokenizer, len(vocab), special_ids),
    )
    try:
        _facts_cache[tokenizer] = facts
    except TypeError:
        pass  # not weak-referenceable: recomputed per detokenizer, still correct
    return facts


@dataclass(slots=True)
class DetokenizedDelta:
    """Text that became certain in one `push`; `stop_sequence` is set when a stop string completed in it
    (the text then ends at the stop, and generation must end)."""

    text: str
    stop_sequence: str | None = None


class IncrementalDetokenizer:
    """Turns a request's generated ids into text, a few ids at a time.

    Contract: without a stop hit, the concatenation of every `push(...).text` and `flush()` equals
    `tokenizer.decode(all_ids, skip_special_tokens=...)` exactly for byte-level BPE and SentencePiece-style
    (Metaspace, byte fallback) tokenizers; not for `clean_up_tokenization_spaces`, which rewrites text
    already streamed.
    With a stop hit, it equals that text cut right before the stop (right after it when
    `include_stop_sequence`), and nothing is emitted afterwards. Not thread-safe; one per request.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        stop_sequences: Sequence[str] = (),
        include_stop_sequence: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not stop for stop in stop_sequences):
            raise ValueError("stop sequences must not be empty strings")
        self._facts = _tokenizer_facts(tokenizer)
        self._stops = tuple(dict.fromkeys(stop_sequences))
        self._include_stop = include_stop_sequence
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        # ids[prefix_offset:read_offset] were decoded and emitted already; they are decoded again only as
        # context for what follows. ids[read_offset:] are not yet emitted.
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending = ""  # certain text held back because it may be the start of a stop sequence
        self._stopped_on: str | None = None
        self._done = False

    @property
    def stopped_on(self) -> str | None:
        """The stop sequence that ended the text, if one did (in `push` or in `flush`)."""
        return self._stopped_on

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add newly generated ids; return the text that is now certain. Empty once a stop was hit."""
        if self._done:
            return DetokenizedDelta("")
        self._ids.extend(token_ids)
        return self._release(self._read_new())

    def flush(self) -> str:
        """At the end of a generation that hit no stop: everything still held back (including an incomplete
        character, as decode renders it). A stop sequence completing in that text still cuts it, and
        `stopped_on` says so. Later calls return ""."""
        if self._done:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        tail = self._decode(self._prefix_offset, len(self._ids))[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        text = self._pending + tail
        self._pending = ""
        self._done = True
        hit = self._find_stop(text)
        if hit is None:
            return text
        start, end, stop = hit
        self._stopped_on = stop
        return text[:end] if self._include_stop else text[:start]

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return self._facts.decode(self._ids[start:stop], self._skip_special)

    def _read_new(self) -> str:
        """Text of the ids not yet read, once it is complete; "" while it is not (and nothing advances)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._ids))
        # No growth: special tokens skipped, or bytes that do not make a character yet.
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR) or self._byte_run_open():
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix_text) :]

    def _byte_run_open(self) -> bool:
        """Whether the last token the decoder sees is a byte-fallback token (so the next may join its run)."""
        if not self._facts.byte_ids:
            return False
        for token in reversed(self._ids):
            if self._skip_special and token in self._facts.special_ids:
                continue  # skipped before decoding: the tokens around it form one run
            return token in self._facts.byte_ids
        return False

    def _release(self, new: str) -> DetokenizedDelta:
        """Apply the stop sequences to newly certain text: emit what can no longer be part of one."""
        if not self._stops:
            return DetokenizedDelta(new)
        text = self._pending + new
        hit = self._find_stop(text)
        if hit is not None:
            start, end, stop = hit
            self._pending = ""
            self._stopped_on = stop
            self._done = True
            return DetokenizedDelta(text[:end] if self._include_stop else text[:start], stop)
        held = self._stop_prefix_len(text)
        self._pending = text[len(text) - held :] if held else ""
        return DetokenizedDelta(text[: len(text) - held])

    def _find_stop(self, text: str) -> tuple[int, int, str] | None:
        """The stop sequence that completes first in `text` (earliest end; on a tie the longer one).

        Only `text` (held-back + new) needs searching: any occurrence starting earlier would have had its
        beginning held back, so it starts inside `text`.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best[1] or (end == best[1] and start < best[0]):
                best = (start, end, stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop sequence."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
