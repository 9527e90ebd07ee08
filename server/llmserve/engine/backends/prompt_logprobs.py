"""Prompt log-probabilities: from a prefill chunk's logits at every scored position to each next prompt token's
log-probability and the most likely tokens there (the per-request lists they add up to over the chunks are kept
with the rest of a sequence's state between steps: paged.py's `SequenceStates`).

The logits arrive as the forward's kept rows (float32), one per scored position, in plan order; `score` takes
`log_softmax` of them in float32 on the backend's device and gathers there, so that only the few numbers asked for
cross to the host. Only the rows of requests that ask are computed at all: the forward keeps no other prompt row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmserve.engine.types.outputs import TokenLogprob

__all__ = ["score"]


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
