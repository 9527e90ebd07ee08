"""backends/paged.py: what the paged step keeps of each sequence between steps (`SequenceStates`), dropped whole by
one release; the step itself runs in every engine test (the CPU backend's, tests/engine/backends/cpu/)."""

from __future__ import annotations

import torch

from llmserve.engine.backends.paged import SequenceStates
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.outputs import TokenLogprob
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import SamplingParams


def test_chunks_add_up_and_a_restart_drops_an_earlier_attempt() -> None:
    states = SequenceStates(torch.device("cpu"))
    a, b, c = TokenLogprob(1, -1.0), TokenLogprob(2, -2.0), TokenLogprob(3, -3.0)
    states.add_scores(7, [a], restart=True)
    states.add_scores(7, [b], restart=False)
    assert states.take_scores(7) == [a, b] and states.take_scores(7) == []
    states.add_scores(8, [a, b], restart=True)
    states.add_scores(8, [c], restart=True)  # preempted and read again from position 0
    assert states.take_scores(8) == [c]
    states.add_scores(9, [a], restart=True)
    states.release(9)
    states.release(9)  # twice, or a key never scored: nothing to drop
    assert states.take_scores(9) == []


def test_a_pooling_restarts_with_the_prompt_and_ends_with_its_last_chunk() -> None:
    states = SequenceStates(torch.device("cpu"))
    states.add_pooled(3, PoolingMode.MEAN, torch.ones(2, 4), restart=True)
    states.add_pooled(3, PoolingMode.MEAN, torch.full((2, 4), 3.0), restart=False)
    assert torch.equal(states.take_pooled(3), torch.full((4,), 2.0))
    states.add_pooled(3, PoolingMode.MEAN, torch.ones(2, 4), restart=True)
    states.add_pooled(3, PoolingMode.MEAN, torch.full((1, 4), 5.0), restart=True)  # preempted: read again
    assert torch.equal(states.take_pooled(3), torch.full((4,), 5.0))


def test_one_release_drops_everything_a_sequence_holds() -> None:
    states = SequenceStates(torch.device("cpu"))
    row = SampleRow(SamplingParams(temperature=0.8), 11, 5, [1, 2], [], False, 0)
    first = states.streams.stream(row)
    states.add_pooled(5, PoolingMode.MEAN, torch.ones(1, 4), restart=True)
    states.add_scores(5, [TokenLogprob(1, -1.0)], restart=True)
    assert len(states) == 1
    states.release(5)
    assert 5 not in states.streams and len(states) == 0
    assert states.take_scores(5) == []
    assert states.streams.stream(row) is not first  # a stream started afresh from the seed
    states.release(5)
    states.add_pooled(5, PoolingMode.MEAN, torch.full((1, 4), 2.0), restart=False)  # no earlier state left
    assert torch.equal(states.take_pooled(5), torch.full((4,), 2.0))
