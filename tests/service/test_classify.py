"""Classification over gRPC (issue 44): tiny LlamaForSequenceClassification and Qwen2ForSequenceClassification
(decoders, their `score` head over the last token: prefill-only requests of the continuous batch) and a tiny
BertForSequenceClassification (an encoder, its
pooler and classifier over [CLS]: rows of the encoder's steps), random weights from a fixed seed, each loaded from its
folder as `--model` loads it. Embed returns transformers' logits and their softmax with the labels of id2label, alone
and batched, on llmserve.v1; the vLLM protocol's Embed returns the logits (what smg's /v1/classify reads); both
surfaces say the model classifies and does not generate; Generate is FAILED_PRECONDITION and the vector's options are
INVALID_ARGUMENT naming the field. One server per model, its engine in process (the load path is `--model`'s)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from harness import ServerThread, bad_request_fields, engine_config
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from llmserve.models.loader import load_model
from llmserve_client import pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc
from tests.classifier_models import reference_logits, save_bert_classifier, save_llama_classifier

TEXTS = [
    "The river runs to the sea.",
    "A short one.",
    "Prices rose sharply in the third quarter of the year, and nobody saw it coming.",
    "I did not like this film at all.",
]
TOLERANCE = 1e-4  # float32 logits against transformers'
LABELS = {
    "llama": ["negative", "neutral", "positive"],
    "qwen2": ["negative", "neutral", "positive"],
    "bert": ["ham", "spam"],
}
POOLING = {"llama": pb.POOLING_LAST, "qwen2": pb.POOLING_LAST, "bert": pb.POOLING_CLS}


@pytest.fixture(scope="module", params=["llama", "qwen2", "bert"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def folder(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if kind == "bert":
        return save_bert_classifier(tmp_path_factory.mktemp(kind))
    return save_llama_classifier(tmp_path_factory.mktemp(kind), qwen2=kind == "qwen2")


@pytest.fixture(scope="module")
def reference(folder: Path) -> torch.Tensor:
    return reference_logits(folder, TEXTS)


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerThread]:
    from llmserve.engine.frontend.async_engine import AsyncEngine

    loaded = load_model(folder, device="cpu", dtype="float32")
    srv = ServerThread(AsyncEngine(loaded, engine_config(kv_cache_tokens=8192))).start()
    yield srv
    srv.stop()


# `channel` and `stub` are conftest's, over this module's `server`.


def _classify(stub: generate_pb2_grpc.GenerateServiceStub, texts: list[str]) -> pb.EmbedResponse:
    response: pb.EmbedResponse = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts]), timeout=60)
    assert [e.index for e in response.embeddings] == list(range(len(texts)))
    return response


def _check(response: pb.EmbedResponse, want: torch.Tensor, labels: list[str]) -> None:
    assert list(response.labels) == labels
    logits = torch.tensor([list(e.values) for e in response.embeddings])
    probabilities = torch.tensor([list(e.probabilities) for e in response.embeddings])
    assert logits.shape == probabilities.shape == want.shape
    assert (logits - want).abs().max().item() <= TOLERANCE
    assert (probabilities - torch.softmax(want, dim=-1)).abs().max().item() <= TOLERANCE


def test_model_info_says_it_classifies(stub: generate_pb2_grpc.GenerateServiceStub, kind: str) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert list(info.tasks) == [pb.TASK_CLASSIFY, pb.TASK_RERANK]  # it also scores pairs: test_cross_encoder.py
    assert (info.embedding_size, list(info.labels)) == (len(LABELS[kind]), LABELS[kind])
    assert (info.pooling, info.normalize) == (POOLING[kind], False)
    assert info.max_embed_inputs > 0


def test_logits_and_probabilities_equal_transformers_alone_and_batched(
    stub: generate_pb2_grpc.GenerateServiceStub, kind: str, reference: torch.Tensor
) -> None:
    # The references differ from text to text by far more than the tolerance: a wrong token pooled would show.
    assert torch.cdist(reference, reference).fill_diagonal_(1.0).min().item() > 10 * TOLERANCE
    for i, text in enumerate(TEXTS):
        _check(_classify(stub, [text]), reference[i : i + 1], LABELS[kind])
    _check(_classify(stub, TEXTS), reference, LABELS[kind])
    # Again: a decoder's last token now starts from the prefix cache, and is recomputed.
    _check(_classify(stub, TEXTS[:1]), reference[:1], LABELS[kind])


def test_a_decoders_input_longer_than_a_step_is_read_in_chunks_and_scored_at_its_end(
    stub: generate_pb2_grpc.GenerateServiceStub, kind: str, folder: Path
) -> None:
    if kind == "bert":
        pytest.skip("an encoder reads each input whole, within one step's token budget")
    text = " ".join(f"item {i} of a long list," for i in range(90))  # 800 tokens: two chunks of 512 at most
    _check(_classify(stub, [text, TEXTS[1]]), reference_logits(folder, [text, TEXTS[1]]), LABELS[kind])


def test_the_vllm_protocol_returns_the_logits_and_no_generation(
    channel: grpc.Channel, folder: Path, reference: torch.Tensor
) -> None:
    """What smg's /v1/classify sends: one tokenized input; it reads the vector as logits and applies softmax."""
    from transformers import AutoTokenizer

    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    assert not vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30).is_generation
    ids = AutoTokenizer.from_pretrained(folder, local_files_only=True)(TEXTS[2])["input_ids"]
    request = vpb.EmbedRequest(request_id="c1", tokenized=vpb.TokenizedInput(original_text=TEXTS[2], input_ids=ids))
    answer = vllm.Embed(request, timeout=60)
    assert (answer.prompt_tokens, answer.embedding_dim) == (len(ids), reference.shape[1])
    assert (torch.tensor(list(answer.embedding)) - reference[2]).abs().max().item() <= TOLERANCE


def test_generate_on_a_classifier_is_failed_precondition(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="hello"), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not generate" in err.value.details()
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    request = vpb.GenerateRequest(request_id="g1", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]))
    with pytest.raises(grpc.RpcError) as err:
        list(vllm.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    ("field", "options"),
    [("normalize", {"normalize": False}), ("dimensions", {"dimensions": 1}), ("pooling", {"pooling": pb.POOLING_MEAN})],
)
def test_the_vectors_options_are_refused_naming_the_field(
    stub: generate_pb2_grpc.GenerateServiceStub, field: str, options: dict[str, object]
) -> None:
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], **options)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert bad_request_fields(err.value) == [field]


def test_the_cli_prints_each_texts_probabilities_by_label(
    server: ServerThread, reference: torch.Tensor, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmserve_client.cli import main

    assert main(["--address", server.address, "embed", TEXTS[0], TEXTS[1]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [list(line["probabilities"]) for line in lines] == [LABELS[kind]] * 2
    got = torch.tensor([list(line["probabilities"].values()) for line in lines])
    assert (got - torch.softmax(reference[:2], dim=-1)).abs().max().item() <= TOLERANCE
