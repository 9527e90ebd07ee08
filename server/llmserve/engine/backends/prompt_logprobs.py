"""Prompt log-probabilities: from a prefill chunk's logits at every scored position to each next prompt token's
log-probability and the most likely tokens there, and the per-request lists they add up to over the chunks.

The logits arrive as the forward's kept rows (float32), one per scored position, in plan order; `score` takes
`log_softmax` of them in float32 on the backend's device and gathers there, so that only the few numbers asked for
cross to the host. Only the rows of requests that ask are computed at all: the forward keeps no other prompt row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmserve.engine.types.outputs import TokenLogprob

__all__ = ["PromptScores", "score"]


def score(logits: torch.Tensor, targets: Sequence[int], tops: Sequence[int]) -> list[TokenLogprob]:
    """Row i of `logits` [n, vocab] scores token `targets[i]`: its log-probability under log_softmax (float32) and
    the `tops[i]` most likely tokens, most likely first (ties in torch.topk's order)."""
    if logits.shape[0] != len(targets) or len(targets) != len(tops):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(targets)} targets and {len(tops)} top counts")
    if not targets:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, index[:, None])[:, 0].tolist()
    n_top = min(max(tops), logp.shape[1])
    top_ids: list[list[int]] = [[] for _ in targets]
    top_values: list[list[float]] = [[] for _ in targets]
    if n_top > 0:
        top = logp.topk(n_top, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprob(t, lp, list(zip(ids[:n], values[:n], strict=True)))
        for t, lp, ids, values, n in zip(targets, chosen, top_ids, top_values, tops, strict=True)
    ]


class PromptScores:
    """The prompt logprobs of every sequence whose prompt is being read in chunks, by sequence key: added chunk by
    chunk (`add`), taken whole with the chunk that ends the prompt (`take`), dropped when the sequence ends
    otherwise (`release`, the core's, as for a random stream)."""

    __slots__ = ("_lists",)

    def __init__(self) -> None:
        self._lists: dict[int, list[TokenLogprob]] = {}

    def __len__(self) -> int:
        return len(self._lists)

    def add(self, key: int, scores: list[TokenLogprob], *, restart: bool) -> None:
        """A chunk's scores for `key`, in prompt order; `restart`: the chunk is the prompt's first (again, after a
        preemption), so that what an earlier attempt added is dropped."""
        if restart or key not in self._lists:
            self._lists[key] = []
        self._lists[key].extend(scores)

    def take(self, key: int) -> list[TokenLogprob]:
        """Every score of `key`'s prompt, its list dropped."""
        return self._lists.pop(key, [])

    def release(self, key: int) -> None:
        self._lists.pop(key, None)
