"""backends/prompt_logprobs.py: scoring rows of logits against their next prompt token (the per-request lists kept
across prompt chunks: tests/engine/backends/test_paged.py)."""

from __future__ import annotations

import torch

from llmserve.engine.backends.prompt_logprobs import score


def test_each_row_scores_its_target_with_its_own_top_n() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    want = torch.log_softmax(logits, dim=-1)
    got = score(logits, [7, 0, 49], [0, 3, 1])
    assert [lp.token_id for lp in got] == [7, 0, 49]
    assert [lp.logprob for lp in got] == [want[0, 7].item(), want[1, 0].item(), want[2, 49].item()]
    top = want.topk(3, dim=-1)
    assert got[0].top == []
    assert got[1].top == list(zip(top.indices[1].tolist(), top.values[1].tolist(), strict=True))
    assert got[2].top == [(top.indices[2, 0].item(), top.values[2, 0].item())]
    assert score(logits[:0], [], []) == []


def test_logprobs_are_taken_in_float32() -> None:
    logits = torch.tensor([[1000.0, 0.0, -5.0]], dtype=torch.bfloat16)
    (lp,) = score(logits, [2], [0])
    assert lp.logprob == torch.log_softmax(logits.float(), dim=-1)[0, 2].item()
