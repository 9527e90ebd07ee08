"""Suffix decoding: drafts from a suffix tree over the request's own context and over recent answers.

Arctic Inference's suffix trees (PyPI `arctic-inference`, its `suffix_decoding` extension: C++ with no torch at run
time; arXiv 2411.04975) do the matching: each live request has a tree over its prompt and output, and each
identity one tree over the answers the server produced for it lately. A draft is the most frequent continuation of
the longest suffix of the context found in either tree, cut where a token's estimated probability falls below
`min_token_prob`, and at `max_spec_factor` x the match length.

Never across identities: the answers' tree belongs to one cache salt (the key that scopes the prefix cache,
`GenerationRequest.cache_salt`), so a caller's drafts never come from another identity's answers. Bounded: at most
`max_answers` answers per identity (the oldest dropped first) and `max_identities` identities (the least recently
used dropped first; an identity with a live request is kept until its last request ends).

The library builds from source (there is no wheel), and its build asks for torch: `make install` builds it against
the venv's own torch (`--no-build-isolation`), which pip would otherwise fetch in another version for the build.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class SuffixConfig:
    """The trees' depth (the longest context suffix matched), the bounds, and when a draft stops (see the module
    docstring); `k`: the most tokens proposed. `max_spec_factor` 4 rather than Arctic's and vLLM's 1: replayed over
    SmolLM2's answers to the editing prompts at one stream, 1 gave mostly 1-token guesses (2.58 tokens per step at
    k <= 15), 2 gave 2.78 and 4 gave 2.87; chat 1.30 -> 1.33; `min_token_prob` 0-0.1 and depth 24 or 64 changed
    nothing there (benchmarks/probes/spec_replay.py, retired, last at 8f85198; benchmarks/README.md)."""

    max_depth: int = 24
    max_answers: int = 256
    max_identities: int = 64
    min_token_prob: float = 0.1
    max_spec_factor: float = 4.0
    k: int = 16

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_answers < 1 or self.max_identities < 1 or self.k < 1:
            raise ValueError("max_depth, max_answers, max_identities and k must be >= 1")


def available() -> bool:
    """Whether the suffix-tree library imports here."""
    try:
        _tree_type()
    except ImportError:
        return False
    return True


def _tree_type() -> Any:
    from arctic_inference.suffix_decoding._C import SuffixTree

    return SuffixTree


@dataclass(slots=True)
class _Identity:
    """One cache salt's answers: their tree, and which tree id holds which answer (oldest first)."""

    tree: Any
    answers: OrderedDict[int, None] = field(default_factory=OrderedDict)  # tree ids, oldest first
    live: int = 0  # live requests of this identity


@dataclass(slots=True)
class _Live:
    identity: _Identity
    salt: str | None
    tree: Any  # this request's own tree: prompt and output
    answer_id: int  # its answer's id in the identity's tree
    fed: int  # tokens of the sequence given to the trees so far


class SuffixProposer:
    """Suffix-tree drafts for every live sequence, by its key; `start` before its first `propose`, `release` when
    it ends (its answer stays in its identity's tree)."""

    __slots__ = ("config", "_tree_cls", "_identities", "_live", "_next_id")

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._tree_cls = _tree_type()  # ImportError when the library is missing: the caller checks available()
        self._identities: OrderedDict[str | None, _Identity] = OrderedDict()
        self._live: dict[int, _Live] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._live)

    def start(self, key: int, salt: str | None, prompt: Sequence[int]) -> None:
        """A sequence begins: its own tree gets its prompt, its identity's tree a place for its answer."""
        if key in self._live:
            raise ValueError(f"sequence {key} is already started")
        identity = self._identities.get(salt)
        if identity is None:
            identity = self._identities[salt] = _Identity(self._tree_cls(self.config.max_depth))
        self._identities.move_to_end(salt)
        identity.live += 1  # before any dropping: this one stays
        self._drop_identities()
        own = self._tree_cls(self.config.max_depth)
        own.extend(0, list(prompt))
        answer_id = self._next_id
        self._next_id = (self._next_id + 1) & 0x7FFFFFFF
        identity.answers[answer_id] = None
        while len(identity.answers) > self.config.max_answers:
            oldest = next(iter(identity.answers))
            del identity.answers[oldest]
            identity.tree.remove(oldest)
        self._live[key] = _Live(identity, salt, own, answer_id, len(prompt))

    def propose(self, key: int, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` drafts for sequence `key`, whose tokens (prompt + output) are `tokens`; the output appended
        since the last call goes into both trees first. [] for a sequence not started."""
        live = self._live.get(key)
        limit = self.config.k if k is None else min(k, self.config.k)
        if live is None or limit <= 0:
            return []
        self._feed(live, tokens)
        config = self.config
        context = list(tokens[-config.max_depth :])
        args = (context, limit, config.max_spec_factor, 0.0, config.min_token_prob, False)
        own = live.tree.speculate(*args)
        shared = live.identity.tree.speculate(*args)
        best = own if own.score >= shared.score else shared
        return list(best.token_ids[:limit])

    def release(self, key: int, tokens: Sequence[int] = ()) -> None:
        """A sequence ended with these `tokens` (prompt + the output it was sent): its own tree goes, its answer
        stays for its identity (none held is fine)."""
        live = self._live.pop(key, None)
        if live is None:
            return
        self._feed(live, tokens)
        live.identity.live -= 1
        self._drop_identities()

    @staticmethod
    def _feed(live: _Live, tokens: Sequence[int]) -> None:
        """Give the trees the output appended since the last call."""
        if len(tokens) > live.fed:
            new = list(tokens[live.fed :])
            live.tree.extend(0, new)
            if live.answer_id in live.identity.answers:  # not yet dropped for a newer answer
                live.identity.tree.extend(live.answer_id, new)
            live.fed = len(tokens)

    def _drop_identities(self) -> None:
        """Drop the least recently used identities without a live request while there are too many."""
        excess = len(self._identities) - self.config.max_identities
        for salt in [s for s, identity in self._identities.items() if identity.live == 0][: max(0, excess)]:
            del self._identities[salt]
