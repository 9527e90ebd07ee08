"""n completions of one prompt: the n single-completion requests of an n > 1 request, and their deltas merged into
one stream.

The engine serves completion i as a request of its own (its own sequence, detokenizer, stop strings, constraint
state and random generator). Completions 1..n-1 are submitted `after` completion 0, so the scheduler admits them
once completion 0 has computed the prompt; they share its full KV blocks and copy its partial last one
(scheduler.py): the prompt is computed once, and each completion computes only the prompt's last token, whose
logits pick its own first token. (vLLM v1 fans `n` out to child requests over its prefix cache, which shares the
full blocks only.) This module holds the call's own books: the seed
each completion samples with, and one stream of the n completions' deltas.
"""

from __future__ import annotations

import dataclasses
import random

from llmserve.engine.frontend.outputs import Delta, Usage
from llmserve.engine.frontend.request import GenerationRequest

SEED_MODULUS = 2**63  # seeds are in [0, 2**63): the proto's int64, non-negative


def derive_seed(seed: int, index: int) -> int:
    """The seed completion `index` samples with when the request's seed is `seed`: (seed + index) mod 2**63.

    Completion 0 samples as a single-completion request with `seed` would, completion i as one with the derived
    seed; a replay of the whole request gives the same n answers."""
    return (seed + index) % SEED_MODULUS


def split(request: GenerationRequest) -> list[GenerationRequest]:
    """The single-completion requests (n = 1 each) of `request`, completion 0 first; `[request]` when n is 1.

    A sampled request without a seed gets one picked here, so that its n seeds follow `derive_seed` too (each
    completion reports its own). Greedy completions keep the request's sampling as it is: they are all equal."""
    if request.n == 1:
        return [request]
    sampling = request.sampling
    if sampling.greedy:
        return [dataclasses.replace(request, n=1)] * request.n
    base = sampling.seed if sampling.seed is not None else random.getrandbits(63)
    return [
        dataclasses.replace(request, n=1, sampling=dataclasses.replace(sampling, seed=derive_seed(base, i)))
        for i in range(request.n)
    ]


class Merger:
    """Turns the deltas of n completions, in the order they arrived, into the stream a caller reads.

    Per completion (`Delta.index`) the order is kept and the deltas that arrived together are joined into one
    (Delta.then), except its first delta, which goes alone, as the first token always does. Completions interleave
    in arrival order. When n > 1, the delta that finishes the last completion carries `total_usage`: prompt and
    cached prompt tokens as completion 0 counted them (the prompt once), completion tokens summed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.open = set(range(n))  # completions whose final delta has not been taken yet
        self._started: set[int] = set()
        self._total = Usage(0, 0, 0)

    def take(self, batch: list[Delta]) -> list[Delta]:
        """The deltas to yield for those that arrived since the last call."""
        out: list[Delta] = []
        joinable: dict[int, int] = {}  # completion -> where in `out` its delta is that later ones join
        for delta in batch:
            index = delta.index
            at = joinable.get(index)
            if at is not None:
                out[at] = out[at].then(delta)
                continue
            if index in self._started:
                joinable[index] = len(out)
            self._started.add(index)
            out.append(delta)
        for delta in out:
            if delta.finished:
                self._finish(delta)
        return out

    def _finish(self, delta: Delta) -> None:
        self.open.discard(delta.index)
        total, usage = self._total, delta.usage
        if usage is not None:
            if delta.index == 0:
                total.prompt_tokens, total.cached_prompt_tokens = usage.prompt_tokens, usage.cached_prompt_tokens
            total.completion_tokens += usage.completion_tokens
        if not self.open and self.n > 1:
            delta.total_usage = Usage(total.prompt_tokens, total.cached_prompt_tokens, total.completion_tokens)
