"""Embed from a generative model (`--pooling last`) over gRPC: SmolLM2-135M-Instruct (its float32 weights) serves both
Generate and Embed; Embed's vector is transformers' final hidden state at the last position of the same model, alone
and while generation streams share the steps, whose tokens are those they get alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness import ServerThread

from llmserve.engine.config import EngineConfig
from llmserve.models.gguf import convert_gguf, default_gguf_path
from llmserve.models.loader import load_model
from llmserve_client import pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

pytestmark = [pytest.mark.real_model]

TEXTS = [
    "The river runs to the sea.",
    "A short one.",
    "In the beginning was the word, and the word was with the light, and the light shone in the darkness.",
    "Prices rose sharply in the third quarter of the year.",
]
TOLERANCE = 1e-3  # float32 through 30 layers: the fused forward's sums in another order than transformers'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from llmserve.engine.frontend.async_engine import AsyncEngine

    loaded = load_model(dtype="float32", pooling="last")
    engine = AsyncEngine(loaded, EngineConfig(kv_cache_tokens=8192, max_num_seqs=16, cuda_graphs=False))
    srv = ServerThread(engine).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = convert_gguf(default_gguf_path())
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    rows = []
    with torch.inference_mode():
        for text in TEXTS:
            ids = torch.tensor([tokenizer.encode(text)])
            rows.append(model.model(input_ids=ids).last_hidden_state[0, -1].float())
    return torch.stack(rows)


def embed(stub: generate_pb2_grpc.GenerateServiceStub, texts: list[str]) -> torch.Tensor:
    response = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts]), timeout=120)
    return torch.tensor([list(e.values) for e in response.embeddings])


def generate(stub: generate_pb2_grpc.GenerateServiceStub, text: str) -> list[int]:
    request = pb.GenerateRequest(text=text, stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
    return [t for response in stub.Generate(request, timeout=120) for t in response.token_ids]


def test_model_info_says_it_generates_and_embeds(stub: generate_pb2_grpc.GenerateServiceStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert list(info.tasks) == [pb.TASK_GENERATE, pb.TASK_EMBED]
    assert (info.embedding_size, info.pooling, info.normalize) == (576, pb.POOLING_LAST, False)


def test_last_token_pooling_equals_transformers_alone_and_beside_generation(
    stub: generate_pb2_grpc.GenerateServiceStub, reference: torch.Tensor
) -> None:
    alone = embed(stub, TEXTS)
    assert (alone - reference).abs().max().item() <= TOLERANCE
    prompts = ["Write a haiku about rain.", "List three colours.", "Count from one to ten."]
    streams_alone = [generate(stub, p) for p in prompts]
    streams: dict[int, list[int]] = {}
    vectors: list[torch.Tensor] = []

    def stream(i: int) -> None:
        streams[i] = generate(stub, prompts[i])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for _ in range(3):
        vectors.append(embed(stub, TEXTS))
    for thread in threads:
        thread.join()
    assert [streams[i] for i in range(len(prompts))] == streams_alone
    for got in vectors:
        assert (got - reference).abs().max().item() <= TOLERANCE
