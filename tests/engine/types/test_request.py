"""types/request.py's checks at the context's edge and of a pair's segment ids (the rest of GenerationRequest.validate
is exercised through the servers: tests/service/test_service_errors.py, test_fuzz.py)."""

from __future__ import annotations

import pytest

from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import GenerationRequest, PoolingParams, StoppingParams

POOLING = PoolingParams(PoolingMode.CLS)


def _request(n: int, pooling: PoolingParams | None = None, types: tuple[int, ...] = ()) -> GenerationRequest:
    return GenerationRequest(
        "r", (1,) * n, stopping=StoppingParams(max_new_tokens=1), pooling=pooling, token_type_ids=types
    )


def test_a_pooling_prompt_may_fill_the_context_a_generating_one_leaves_room_for_its_token() -> None:
    _request(8, POOLING).validate(vocab_size=10, max_model_len=8)  # an encoder's 512 positions, all of them
    with pytest.raises(InvalidRequest, match="the context holds 8"):
        _request(9, POOLING).validate(vocab_size=10, max_model_len=8)
    with pytest.raises(InvalidRequest, match="the context holds 8"):
        _request(8).validate(vocab_size=10, max_model_len=8)
    _request(7).validate(vocab_size=10, max_model_len=8)


def test_segment_ids_are_one_per_prompt_token_or_none() -> None:
    _request(4, POOLING, (0, 0, 1, 1)).validate(vocab_size=10, max_model_len=8)
    for types in ((0, 1), (0, 0, 1, -1)):
        with pytest.raises(InvalidRequest) as err:
            _request(4, POOLING, types).validate(vocab_size=10, max_model_len=8)
        assert err.value.field == "token_type_ids"
