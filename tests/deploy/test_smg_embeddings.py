"""The OpenAI SDK's embeddings through the real smg gateway (deploy/smg/launch.sh) to a real llmserve replica serving
all-MiniLM-L6-v2 (`python -m llmserve --model all-minilm-l6-v2`, engine process): smg sees `is_generation` false,
tokenizes with the tokenizer files the replica hands it and sends each input to the vLLM protocol's Embed
(api/vllm_servicer.py), whose vector is llmserve.v1 Embed's for the same text."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from llmserve_client import Client
from tests.deploy.replicas import Replica, serving
from tests.deploy.smg import Smg, smg_binary

pytestmark = pytest.mark.skipif(smg_binary() is None, reason="smg (the gateway extra) is not installed")

TEXTS = ["A cat sat on the mat.", "The quick brown fox jumps over the lazy dog.", "Embeddings through a gateway."]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    with serving(Replica("embed", tmp_path_factory.mktemp("logs"), model="all-minilm-l6-v2")) as (node,):
        yield node


def test_the_sdks_embeddings_are_llmserves_embed(gateway: tuple[Smg, str], replica: Replica) -> None:
    # One text per request: smg (1.13) answered a list of three with one vector.
    smg, model = gateway
    sdk = openai.OpenAI(base_url=smg.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answers = [sdk.embeddings.create(model=model, input=text) for text in TEXTS]
    got = torch.tensor([answer.data[0].embedding for answer in answers])
    with Client(replica.address, timeout=60) as client:
        own = client.embed(TEXTS)
    want = torch.tensor([list(e.values) for e in own.embeddings])
    assert got.shape == want.shape == (3, 384)
    assert (got - want).abs().max().item() <= 1e-5
    assert [a.usage.prompt_tokens for a in answers] == [e.prompt_tokens for e in own.embeddings]


def test_a_text_too_long_for_the_model_is_refused(gateway: tuple[Smg, str]) -> None:
    smg, model = gateway
    sdk = openai.OpenAI(base_url=smg.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as err:
        sdk.embeddings.create(model=model, input="word " * 400)
    assert 400 <= err.value.status_code < 500, err.value
