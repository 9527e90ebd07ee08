"""n completions of one prompt: the n single-completion requests of an n > 1 request, and their deltas merged into
one stream.

The engine serves completion i as a request of its own (its own sequence, detokenizer, stop strings, constraint
state and random generator). Completions 1..n-1 are submitted `after` completion 0, so the scheduler admits them
once completion 0 has computed the prompt; they share its full KV blocks and copy its partial last one
(scheduler.py): the prompt is computed once, and each completion computes only the prompt's last token, whose
logits pick its own first token. (vLLM v1 fans `n` out to child requests over its prefix cache, which shares the
full blocks only.) This module holds the split: the n requests, the seed each completion samples with, and
which one scores the prompt when prompt logprobs are asked (completion 0, whose first delta comes first); their
deltas are merged into one stream by the front end's `DeltaStream` (async_engine.py), which every call reads through.
"""

from __future__ import annotations

import dataclasses
import random

from llmserve.engine.types.request import GenerationRequest

SEED_MODULUS = 2**63  # seeds are in [0, 2**63): the proto's int64, non-negative


def derive_seed(seed: int, index: int) -> int:
    """The seed completion `index` samples with when the request's seed is `seed`: (seed + index) mod 2**63.

    Completion 0 samples as a single-completion request with `seed` would, completion i as one with the derived
    seed; a replay of the whole request gives the same n answers."""
    return (seed + index) % SEED_MODULUS


def split(request: GenerationRequest) -> list[GenerationRequest]:
    """The single-completion requests (n = 1 each) of an n > 1 `request`, completion 0 first (`[request]` when n
    is 1).

    A sampled request without a seed gets one picked here, so that its n seeds follow `derive_seed` too (each
    completion reports its own). Greedy completions keep the request's sampling as it is: they are all equal."""
    if request.n == 1:
        return [request]
    sampling = request.sampling
    if sampling.greedy:
        parts = [dataclasses.replace(request, n=1)] * request.n
    else:
        base = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        parts = [
            dataclasses.replace(request, n=1, sampling=dataclasses.replace(sampling, seed=derive_seed(base, i)))
            for i in range(request.n)
        ]
    if request.prompt_logprobs:  # completion 0 scores the prompt, whose KV the others then share (one answer)
        parts[1:] = [dataclasses.replace(p, prompt_logprobs=False, prompt_top_logprobs=0) for p in parts[1:]]
    return parts
