"""backends/prompt_logprobs.py: scoring rows of logits against their next prompt token, and the per-request lists kept
across prompt chunks."""

from __future__ import annotations

import torch

from llmserve.engine.backends.prompt_logprobs import PromptScores, score
from llmserve.engine.types.outputs import TokenLogprob


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


def test_chunks_add_up_and_a_restart_drops_an_earlier_attempt() -> None:
    scores = PromptScores()
    a, b, c = TokenLogprob(1, -1.0), TokenLogprob(2, -2.0), TokenLogprob(3, -3.0)
    scores.add(7, [a], restart=True)
    scores.add(7, [b], restart=False)
    assert scores.take(7) == [a, b] and len(scores) == 0
    scores.add(8, [a, b], restart=True)
    scores.add(8, [c], restart=True)  # preempted and read again from position 0
    assert scores.take(8) == [c]
    scores.add(9, [a], restart=True)
    scores.release(9)
    scores.release(9)  # twice, or a key never scored: nothing to drop
    assert len(scores) == 0 and scores.take(9) == []
