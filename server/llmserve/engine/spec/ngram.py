"""Prompt lookup: draft the tokens that followed the last occurrence of the sequence's own recent n-gram.

vLLM's `ngram` method (`prompt_lookup_min` / `prompt_lookup_max`): find the longest n in [min_n, max_n] such that
the sequence's last n tokens (prompt and output) occurred earlier in it, and propose the up to k tokens that
followed that occurrence. vLLM scans the whole context on every call (KMP over the reversed tokens); here each
sequence keeps an index, one dict per n from n-gram to where it occurred, caught up with the tokens appended since
the last call, so that a call costs a few dict look-ups however long the context is (the phase-1
probe spec_proposers.py measured it at 32 sequences, benchmarks/README.md).

Which occurrence, when an n-gram occurred several times: the most recent one by default (`latest`), the earliest
as vLLM does otherwise; the phase-1 probe compared the two on SmolLM2's answers.

Torch-free and model-free: the drafts are only guesses, every one is verified against the model's own pick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class NgramConfig:
    """`min_n`..`max_n`: the n-gram lengths looked up (longest first); `k`: the most tokens proposed; `latest`: of
    several earlier occurrences, continue the most recent one (else the earliest)."""

    min_n: int = 2
    max_n: int = 4
    k: int = 16
    latest: bool = True

    def __post_init__(self) -> None:
        if not (1 <= self.min_n <= self.max_n):
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")


@dataclass(slots=True)
class NgramIndex:
    """One sequence's n-gram index: for each n, n-gram -> the end (exclusive) of its latest occurrence that has a
    token after it (or its earliest, without `latest`). `propose` catches up with the tokens appended since the last
    call: a sequence's tokens only grow while it lives; a list shorter than the last is indexed again from the start.
    """

    config: NgramConfig
    _ends: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    _indexed: int = 0  # the n-grams that end before this position are in the index

    def __post_init__(self) -> None:
        self._ends = [{} for _ in range(self.config.min_n, self.config.max_n + 1)]

    def propose(self, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: the config's) tokens that followed the latest earlier occurrence of the longest
        suffix n-gram of `tokens`; [] when none occurred."""
        limit = self.config.k if k is None else min(k, self.config.k)
        if limit <= 0:
            return []
        self._catch_up(tokens)
        total = len(tokens)
        config = self.config
        for n in range(min(config.max_n, total - 1), config.min_n - 1, -1):
            end = self._ends[n - config.min_n].get(tuple(tokens[total - n :]))
            if end is not None:
                return list(tokens[end : min(end + limit, total)])
        return []

    def _catch_up(self, tokens: Sequence[int]) -> None:
        total = len(tokens)
        if total < self._indexed:
            self._ends = [{} for _ in self._ends]
            self._indexed = 0
        # An n-gram ending at `end` is indexed once a token follows it (end < total): the suffix itself is not.
        min_n, latest = self.config.min_n, self.config.latest
        for offset, ends in enumerate(self._ends):
            n = min_n + offset
            for end in range(max(n, self._indexed), total):
                gram = tuple(tokens[end - n : end])
                if latest:
                    ends[gram] = end
                else:
                    ends.setdefault(gram, end)
        self._indexed = total


class NgramProposer:
    """Prompt-lookup drafts for every live sequence, by its key (the engine's sequence handle)."""

    __slots__ = ("config", "_indexes")

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._indexes: dict[int, NgramIndex] = {}

    def __len__(self) -> int:
        return len(self._indexes)

    def propose(self, key: int, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Drafts for sequence `key` whose tokens (prompt + output) are `tokens`; see NgramIndex.propose."""
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = NgramIndex(self.config)
        return index.propose(tokens, k)

    def release(self, key: int) -> None:
        """Forget a sequence that ended (none held is fine)."""
        self._indexes.pop(key, None)
