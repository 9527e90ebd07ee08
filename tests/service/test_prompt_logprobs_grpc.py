"""Prompt log-probabilities over gRPC (issue 44's acceptance): SmolLM2-135M-Instruct's float32 weights, prompt caching
on, a prefill chunk of 32 tokens. Each prompt token's logprob (and the top 5) equals `log_softmax` of transformers'
logits of the same model, for a prompt shorter and one longer than the chunk, with and without a prefix-cache hit
and after a session turn (a request that asks reads no cached KV: usage.cached_prompt_tokens is 0)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from harness import ServerThread, bad_request_fields

from llmserve.engine.config import EngineConfig
from llmserve.models.gguf import convert_gguf, default_gguf_path
from llmserve.models.loader import load_model
from llmserve_client import build_request, pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

pytestmark = [pytest.mark.real_model]

CHUNK = 32  # the prefill chunk (max_num_batched_tokens): LONG is read in three chunks
SHORT = "The quick brown fox jumps over the lazy dog."
LONG = (
    "In the beginning the river ran quietly through the valley, past the mill and the old stone bridge, where the "
    "children of the village gathered every evening to watch the light fade over the hills. Nobody remembered who "
    "had built the bridge, and the miller, who was the oldest man in the valley, said only that it had always been "
    "there, as the river had, and that it would outlast them all."
)
TOP = 5
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from llmserve.engine.frontend.async_engine import AsyncEngine

    config = EngineConfig(kv_cache_tokens=8192, max_num_seqs=8, max_num_batched_tokens=CHUNK, cuda_graphs=False)
    srv = ServerThread(AsyncEngine(load_model(dtype="float32"), config)).start()
    yield srv
    srv.stop()


class Reference:
    """transformers' float32 model on the same weights: each prompt's log_softmax, computed once per prompt."""

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM

        folder = convert_gguf(default_gguf_path())
        self.model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        self._done: dict[tuple[int, ...], torch.Tensor] = {}

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1, vocab]: row i is the distribution of token i + 1 given tokens 0..i."""
        key = tuple(ids)
        if key not in self._done:
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            self._done[key] = torch.log_softmax(logits, dim=-1)
        return self._done[key]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def call(stub: generate_pb2_grpc.GenerateServiceStub, prompt: str | list[int], **options: Any) -> list[Any]:
    kwargs: dict[str, Any] = {"token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    options.setdefault("max_new_tokens", 2)
    request = build_request(**kwargs, ignore_eos=True, return_prompt_token_ids=True, return_token_ids=True, **options)
    return list(stub.Generate(request, timeout=120))


def scored(stub: generate_pb2_grpc.GenerateServiceStub, prompt: str | list[int], **options: Any) -> list[Any]:
    return call(stub, prompt, prompt_logprobs=True, prompt_top_logprobs=TOP, **options)


def check(responses: list[Any], reference: Reference) -> None:
    """The first message's prompt logprobs equal the reference's at every prompt token, top-n too; no other message
    carries any; nothing of the prompt was read from a cache."""
    first = responses[0]
    ids = list(first.prompt_token_ids)
    want = reference.logprobs(ids)
    got = list(first.prompt_logprobs)
    assert [lp.token_id for lp in got] == ids[1:]
    values = torch.tensor([lp.logprob for lp in got])
    expected = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (values - expected).abs().max().item() <= TOLERANCE
    top = want.topk(TOP, dim=-1)
    for i, lp in enumerate(got):
        assert len(lp.top_logprobs) == TOP
        top_values = torch.tensor([t.logprob for t in lp.top_logprobs])
        assert (top_values - top.values[i]).abs().max().item() <= TOLERANCE
        # Ids as torch.topk orders them, except between alternatives closer than the tolerance (either order).
        for j, t in enumerate(lp.top_logprobs):
            if t.token_id != top.indices[i, j].item():
                assert abs(want[i, t.token_id].item() - top.values[i, j].item()) <= TOLERANCE
    assert all(not r.prompt_logprobs for r in responses[1:])
    assert responses[-1].usage.cached_prompt_tokens == 0


def test_prompt_logprobs_equal_transformers_short_and_longer_than_a_chunk(
    stub: generate_pb2_grpc.GenerateServiceStub, reference: Reference
) -> None:
    short, long = scored(stub, SHORT), scored(stub, LONG)
    assert len(long[0].prompt_token_ids) > 2 * CHUNK
    check(short, reference)
    check(long, reference)
    # Without top-n: each token's own logprob only; without the option: none.
    plain = call(stub, SHORT, prompt_logprobs=True)
    assert [lp.logprob for lp in plain[0].prompt_logprobs] == pytest.approx(
        [lp.logprob for lp in short[0].prompt_logprobs], abs=TOLERANCE
    )
    assert all(not lp.top_logprobs for lp in plain[0].prompt_logprobs)
    assert not call(stub, SHORT)[0].prompt_logprobs


def test_a_prefix_cache_hit_is_recomputed_and_what_it_computes_is_cached(
    stub: generate_pb2_grpc.GenerateServiceStub, reference: Reference
) -> None:
    prompt = LONG + " The end."
    call(stub, prompt)
    assert call(stub, prompt)[-1].usage.cached_prompt_tokens >= CHUNK  # the prompt is cached now
    check(scored(stub, prompt), reference)  # and recomputed for the scores
    # A new prompt scored first: its blocks enter the prefix cache, and a plain call reuses them.
    fresh = "A different story: " + LONG
    check(scored(stub, fresh), reference)
    assert call(stub, fresh)[-1].usage.cached_prompt_tokens >= CHUNK


def test_after_a_session_turn_the_prompt_is_recomputed(
    stub: generate_pb2_grpc.GenerateServiceStub, reference: Reference
) -> None:
    # Two sessions hold the same first turn; the second turn reuses it plainly in one, and is scored in the other.
    first = call(stub, LONG, session_id="plain", max_new_tokens=8)
    assert call(stub, LONG, session_id="scored", max_new_tokens=8)[-1].token_ids == first[-1].token_ids
    history = list(first[0].prompt_token_ids) + [t for r in first for t in r.token_ids]
    turn = history + list(range(300, 310))
    assert call(stub, turn, session_id="plain", max_new_tokens=1)[-1].usage.cached_prompt_tokens >= CHUNK
    check(scored(stub, turn, session_id="scored"), reference)


@pytest.mark.parametrize("top", [-1, 21])
def test_prompt_top_logprobs_out_of_range_is_invalid_argument(
    stub: generate_pb2_grpc.GenerateServiceStub, top: int
) -> None:
    request = build_request(SHORT, max_new_tokens=1)
    request.response.prompt_top_logprobs = top
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["response.prompt_top_logprobs"]
    # The server serves the next call as before.
    assert call(stub, SHORT)[-1].finish_reason == pb.FINISH_REASON_LENGTH
