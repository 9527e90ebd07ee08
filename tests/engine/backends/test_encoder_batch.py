"""An encoder step's packed inputs (engine/backends/encoder_batch.py): the runs of sequences that attend together,
and the batches refused. The encoder's forward over them is tests/models/test_encoder.py's."""

from __future__ import annotations

import pytest

from llmserve.engine.backends.encoder_batch import PADDING_SLACK, EncoderBatch


def test_sequences_attend_in_groups_of_like_length() -> None:
    """Consecutive sequences share an attention call while padding them to the group's longest stays within the
    slack; a group of equal lengths needs no padding (no scatter, no mask)."""
    lens = [3, 3, 3, 4, 10, 11, 12, 40]
    batch = EncoderBatch.pack([[101] * n for n in lens])
    assert [(g.start, g.stop, g.count, g.longest) for g in batch.groups] == [
        (0, 13, 4, 4),
        (13, 46, 3, 12),
        (46, 86, 1, 40),
    ]
    for group in batch.groups:
        assert group.count * group.longest <= PADDING_SLACK * (group.stop - group.start)
    first, _, alone = batch.groups
    assert first.scatter is not None and first.scatter.tolist()[:4] == [0, 1, 2, 4]  # row 3 is the first one's padding
    assert first.key_mask is not None and first.key_mask[:, 0, 0].tolist()[0] == [True, True, True, False]
    assert alone.scatter is None and alone.key_mask is None


def test_bad_batches_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one sequence"):
        EncoderBatch.pack([])
    with pytest.raises(ValueError, match="at least one sequence"):
        EncoderBatch.pack([[1, 2], []])
    with pytest.raises(ValueError, match="one entry per token"):
        EncoderBatch.pack([[1, 2]], token_type_ids=[[0]])
