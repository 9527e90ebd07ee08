"""Each sampled sequence's random stream: started from its seed on first use, going on from call to call while its
key lives, dropped on release (the engine's side of it, preemption and every way a request ends, is in test_core)."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.sample.sampler import sample
from llmserve.engine.sample.streams import RandomStreams
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.request import SamplingParams


def test_a_streams_draws_go_on_while_its_key_lives_and_start_afresh_once_released() -> None:
    """The k-th call draws the stream's k-th uniform (eight equal logits: token floor(8u)); greedy rows hold none."""
    logits = torch.zeros(1, 8)
    first_four = torch.rand(4, generator=torch.Generator().manual_seed(11)).tolist()
    streams = RandomStreams()
    sampled = SampleRow(SamplingParams(temperature=1.0), 11, 7, [], [], False, 0)
    assert [sample(logits, [sampled], streams)[0][0] for _ in range(4)] == [int(8 * u) for u in first_four]
    sample(logits, [SampleRow(SamplingParams(), None, 8, [], [], False, 0)], streams)
    assert len(streams) == 1 and 7 in streams
    streams.release(7)
    streams.release(7)  # twice, or a key never sampled: nothing to drop
    assert len(streams) == 0
    assert sample(logits, [sampled], streams)[0] == [int(8 * first_four[0])]


def test_a_row_without_a_seed_fails_before_any_stream_moves_on() -> None:
    logits = torch.zeros(2, 8)
    streams, good = RandomStreams(), SampleRow(SamplingParams(temperature=1.0), 3, 1, [], [], False, 0)
    with pytest.raises(ValueError, match="sequence 2: sampled .* without a seed"):
        sample(logits, [good, SampleRow(SamplingParams(temperature=1.0), None, 2, [], [], False, 0)], streams)
    u = torch.rand((), generator=torch.Generator().manual_seed(3)).item()
    assert sample(logits[:1], [good], streams)[0] == [int(8 * u)]  # its first draw is still to come
