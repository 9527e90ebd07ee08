"""Rerank over gRPC (issue 54): random-weight BERT cross-encoders (BertForSequenceClassification with the
all-MiniLM-L6-v2 package's BERT tokenizer, tests/classifier_models.save_cross_encoder), served from their folders, score
(query, document) pairs as sentence-transformers' CrossEncoder.predict does within 1e-5: the pair's segment ids
reach the encoder, a pair too long for the model is cut longest_first, a one-label model's score is the sigmoid and a
two-label model's logits and softmax come back. Alone, many documents a call, and several callers at once; sorted or in
input order, top_n, return_documents; bad requests are INVALID_ARGUMENT naming the field.

Three models, one server each (module-scoped, parametrized): the ms-marco-MiniLM-L-6-v2 shape (6 layers, width 384,
12 heads, 512 positions, one label) and two tiny ones (2 layers, width 64; the tokenizer's max length 64, so that short
texts need truncation) with one label and with two.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from harness import ServerThread, bad_request_fields, engine_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.config import ModelConfig
from llmserve_client import pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc
from tests.classifier_models import MS_MARCO_SHAPE, save_cross_encoder

TOLERANCE = 1e-5
QUERY = "how do rivers reach the sea"
DOCUMENTS = [
    "Rivers flow downhill under gravity until they reach a lake or the ocean.",
    "The cat sat on the mat.",
    "Prices rose sharply in the third quarter of the year, and nobody saw it coming.",
    "A delta forms where a river deposits sediment as it slows entering the sea.",
    "Short.",
    "Mountains are formed by tectonic forces or volcanism.",
    "Water evaporates from the ocean, falls as rain on land, and runs back in streams and rivers.",
    "I did not like this film at all.",
]
# Pairs over 64 tokens (the tiny models' length) and, the last two, over 512 (the ms-marco shape's): a long document
# after a short query, and with a long query before it, longest_first cuts both.
LONG_WORDS = " ".join(f"river{i % 13} bank sediment flows" for i in range(160))
LONG_DOCUMENTS = ["The sea is where most rivers end. " * 6, LONG_WORDS, LONG_WORDS + " " + LONG_WORDS[:300]]
LONG_QUERY = "which rivers carry the most sediment into the sea " * 30
KINDS: dict[str, dict[str, Any]] = {  # save_cross_encoder's arguments
    "ms-marco": dict(initializer_range=0.05, **MS_MARCO_SHAPE),
    "tiny": dict(initializer_range=0.2, max_length=64),
    "two-labels": dict(initializer_range=0.2, max_length=64, labels=2),
}
# The checks of the edge alone (bad requests, fuzz, the CLI, Embed's probabilities) run on the tiny models only.
EDGE_KINDS = ("tiny", "two-labels")


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def folder(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder(tmp_path_factory.mktemp(kind), **KINDS[kind])


@pytest.fixture(scope="module")
def library(folder: Path) -> Any:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerThread]:
    from llmserve.engine.core.process import load_served_model
    from llmserve.engine.frontend.async_engine import AsyncEngine

    # The engine on a thread of this process: an engine process of its own took 20 s to start on the shared CI
    # machine (the requests' segment ids cross to it pickled, as every other field).
    config = engine_config(kv_cache_tokens=16384, max_num_seqs=64, max_num_batched_tokens=1024)
    model = ModelConfig(spec=str(folder), device="cpu", dtype="float32")
    srv = ServerThread(AsyncEngine(load_served_model(model, False), config)).start()
    yield srv
    srv.stop()


# `channel` and `stub` are conftest's, over this module's `server`.


def _want(library: Any, query: str, documents: list[str]) -> torch.Tensor:
    """CrossEncoder.predict's scores: [documents] for one label (sigmoid), [documents, labels] logits for several."""
    return torch.as_tensor(library.predict([(query, d) for d in documents], batch_size=64)).float()


def _rerank(stub: generate_pb2_grpc.GenerateServiceStub, query: str, documents: list[str], **options: Any) -> Any:
    request = pb.RerankRequest(query=query, documents=documents, input_order=True, **options)
    response = stub.Rerank(request, timeout=120)
    if options.get("top_n", 0) == 0:
        assert [r.index for r in response.results] == list(range(len(documents)))
    return response


def _scores(response: Any) -> torch.Tensor:
    return torch.tensor([r.score for r in response.results])


def _check(response: Any, want: torch.Tensor) -> None:
    """The results' scores (one label) or logits (several) against CrossEncoder's."""
    if want.ndim == 1:
        assert (_scores(response) - want).abs().max().item() <= TOLERANCE
        return
    logits = torch.tensor([list(r.logits) for r in response.results])
    assert (logits - want).abs().max().item() <= TOLERANCE
    probabilities = torch.tensor([list(r.probabilities) for r in response.results])
    assert (probabilities - torch.softmax(want, dim=-1)).abs().max().item() <= TOLERANCE
    assert (_scores(response) - probabilities[:, -1]).abs().max().item() <= 1e-7


def _edge_only(kind: str) -> None:
    if kind not in EDGE_KINDS:
        pytest.skip("the edge's checks: run on the tiny models")


def test_model_info_says_it_reranks(stub: generate_pb2_grpc.GenerateServiceStub) -> None:
    assert list(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).tasks) == [pb.TASK_CLASSIFY, pb.TASK_RERANK]


def test_scores_equal_cross_encoders_alone_and_batched(
    stub: generate_pb2_grpc.GenerateServiceStub, library: Any, folder: Path
) -> None:
    want = _want(library, QUERY, DOCUMENTS)
    # The documents' scores differ by far more than the tolerance, and so do those of the pairs read with no segment
    # ids (every token in segment 0): a missing [SEP] or segment would show.
    column = want if want.ndim == 1 else want[:, -1]
    assert torch.cdist(column[:, None], column[:, None]).fill_diagonal_(1.0).min().item() > 10 * TOLERANCE
    assert (_no_segments(library, QUERY, DOCUMENTS) - want).abs().max().item() > 100 * TOLERANCE
    for i, document in enumerate(DOCUMENTS):
        _check(_rerank(stub, QUERY, [document]), want[i : i + 1])
    response = _rerank(stub, QUERY, DOCUMENTS)
    _check(response, want)
    assert not any(r.truncated for r in response.results)
    tokenizer = library.tokenizer
    lengths = [len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS]
    assert [r.prompt_tokens for r in response.results] == lengths
    assert response.usage.prompt_tokens == sum(lengths)
    # Many documents in one call: every engine step holds pairs of several lengths.
    many = [f"{d} ({i})" for i in range(3) for d in DOCUMENTS]
    _check(_rerank(stub, QUERY, many), _want(library, QUERY, many))


def _no_segments(library: Any, query: str, documents: list[str]) -> torch.Tensor:
    tokenizer, model = library.tokenizer, library.model
    encoded = tokenizer(
        [query] * len(documents), documents, padding=True, truncation="longest_first", return_tensors="pt"
    )
    with torch.inference_mode():
        logits = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).logits.float()
    return torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else logits


def test_long_pairs_are_cut_longest_first_as_cross_encoder_cuts_them(
    stub: generate_pb2_grpc.GenerateServiceStub, library: Any
) -> None:
    limit = library.tokenizer.model_max_length
    for query in (QUERY, LONG_QUERY):
        response = _rerank(stub, query, LONG_DOCUMENTS)
        _check(response, _want(library, query, LONG_DOCUMENTS))
        whole = [len(library.tokenizer(query, d)["input_ids"]) for d in LONG_DOCUMENTS]
        assert [r.truncated for r in response.results] == [n > limit for n in whole]
        assert [r.prompt_tokens for r in response.results] == [min(n, limit) for n in whole]
        assert any(r.truncated for r in response.results)


@pytest.mark.parametrize("size", [10_000, 1_000_000])
def test_a_long_document_is_cut_with_its_pair_not_refused(
    stub: generate_pb2_grpc.GenerateServiceStub, library: Any, size: int
) -> None:
    """A 10 KB and a 1 MB document, over --max-prompt-bytes (8,192 bytes on the 512-position model) by far: scored as
    CrossEncoder.predict scores the whole document (its tokenizer cutting the pair longest_first), beside a short one,
    with a short and a long query."""
    document = (LONG_WORDS + " ") * (size // len(LONG_WORDS) + 1)
    document = document.encode()[:size].decode("utf-8", "ignore")
    limit = library.tokenizer.model_max_length
    for query in (QUERY, LONG_QUERY):
        response = _rerank(stub, query, [DOCUMENTS[0], document])
        _check(response, _want(library, query, [DOCUMENTS[0], document]))
        assert [(r.truncated, r.prompt_tokens) for r in response.results][1] == (True, limit)


def test_several_callers_at_once_get_each_their_own_scores(
    stub: generate_pb2_grpc.GenerateServiceStub, library: Any
) -> None:
    """Rerank calls, and Embed calls of single texts between them: steps that mix pairs (segments 0 and 1) with
    texts (no segment ids: all 0) give each its own values."""
    documents = [*DOCUMENTS, LONG_DOCUMENTS[0]]
    queries = [QUERY, "sediment", "what did the critics say about the film"]
    wants = {q: _want(library, q, documents) for q in queries}
    texts = DOCUMENTS[:4]
    alone = [_embed_values(stub, text) for text in texts]
    calls: list[tuple[str, list[str]] | int] = [(queries[i % len(queries)], documents[i % 5 :]) for i in range(8)]
    calls[1:1] = range(len(texts))

    def call(what: tuple[str, list[str]] | int) -> None:
        if isinstance(what, int):
            assert (_embed_values(stub, texts[what]) - alone[what]).abs().max().item() <= TOLERANCE
            return
        query, docs = what
        _check(_rerank(stub, query, docs), wants[query][len(documents) - len(docs) :])

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(call, calls))


def _embed_values(stub: generate_pb2_grpc.GenerateServiceStub, text: str) -> torch.Tensor:
    response = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=text)]), timeout=60)
    return torch.tensor(list(response.embeddings[0].values))


def test_results_come_best_first_top_n_and_with_their_documents(
    stub: generate_pb2_grpc.GenerateServiceStub, library: Any
) -> None:
    want = _want(library, QUERY, DOCUMENTS)
    column = want if want.ndim == 1 else torch.softmax(want, dim=-1)[:, -1]
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -float(column[i]))
    ranked = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS), timeout=60)
    assert [r.index for r in ranked.results] == best
    assert all(r.document == "" for r in ranked.results)
    top = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True), timeout=60)
    assert [(r.index, r.document) for r in top.results] == [(i, DOCUMENTS[i]) for i in best[:3]]
    assert top.usage.prompt_tokens == ranked.usage.prompt_tokens  # every pair was read
    kept = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS, top_n=3, input_order=True), timeout=60)
    assert [r.index for r in kept.results] == sorted(best[:3])
    everything = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS[:2], top_n=10), timeout=60)
    assert len(everything.results) == 2


def test_embed_gives_a_one_label_classifier_the_sigmoid_and_several_the_softmax(
    stub: generate_pb2_grpc.GenerateServiceStub, kind: str
) -> None:
    _edge_only(kind)
    response = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=DOCUMENTS[0])]), timeout=60)
    (embedding,) = response.embeddings
    logits = torch.tensor(list(embedding.values))
    want = torch.sigmoid(logits) if len(logits) == 1 else torch.softmax(logits, dim=-1)
    assert (torch.tensor(list(embedding.probabilities)) - want).abs().max().item() <= 1e-7
    assert list(response.labels) == [f"LABEL_{i}" for i in range(len(logits))]


def test_a_call_is_admitted_as_an_embed_call_is(
    server: ServerThread, stub: generate_pb2_grpc.GenerateServiceStub, kind: str
) -> None:
    """Admitted by its documents, as Embed is by its inputs: with --max-pooling-inputs below a call's documents the
    call is refused whole (RESOURCE_EXHAUSTED with RetryInfo, naming the flag, nothing left counted in), one within
    it is answered; and no Generate stream slot is taken (none are left here)."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    from llmserve.api.admission import Admission

    _edge_only(kind)
    assert server.server is not None
    servicer = server.server.servicer
    admitted = servicer.admission
    cap = len(DOCUMENTS) - 1
    servicer.admission = trial = Admission(0, None, max_pooling_inputs=cap)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-pooling-inputs" in err.value.details(), err.value.details()
        status, retry = rpc_status.from_call(err.value), error_details_pb2.RetryInfo()
        assert status is not None and any(detail.Unpack(retry) for detail in status.details)
        assert retry.retry_delay.seconds + retry.retry_delay.nanos > 0
        assert trial.inputs_in_flight == 0 and len(trial) == 0
        response = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS[:cap]), timeout=60)
        assert len(response.results) == cap
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=d) for d in DOCUMENTS]), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        servicer.admission = admitted
    assert len(admitted) == 0 and len(trial) == 0


@pytest.mark.parametrize(
    ("field", "request_"),
    [
        ("query", pb.RerankRequest(documents=["a"])),
        ("documents", pb.RerankRequest(query="q")),
        ("documents[1]", pb.RerankRequest(query="q", documents=["a", ""])),
        ("top_n", pb.RerankRequest(query="q", documents=["a"], top_n=-1)),
        ("documents", pb.RerankRequest(query="q", documents=["a"] * 257)),
        ("query", pb.RerankRequest(query="a" * 9000, documents=["a"])),  # a document is cut, a query refused
        ("request_id", pb.RerankRequest(query="q", documents=["a"], request_id="x" * 200)),
    ],
)
def test_a_bad_request_is_invalid_argument_naming_the_field(
    stub: generate_pb2_grpc.GenerateServiceStub, kind: str, field: str, request_: Any
) -> None:
    _edge_only(kind)
    with pytest.raises(grpc.RpcError) as err:
        stub.Rerank(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert bad_request_fields(err.value) == [field]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    query=st.text(max_size=30),
    documents=st.lists(st.text(max_size=30), max_size=4),
    top_n=st.integers(-(2**31), 2**31 - 1),
    flags=st.tuples(st.booleans(), st.booleans()),
    request_id=st.sampled_from(["", "id", "x" * 200, "a\nb"]),
)
def test_any_rerank_call_is_answered_or_names_one_field(
    stub: generate_pb2_grpc.GenerateServiceStub,
    kind: str,
    query: str,
    documents: list[str],
    top_n: int,
    flags: tuple[bool, bool],
    request_id: str,
) -> None:
    _edge_only(kind)
    request = pb.RerankRequest(
        query=query,
        documents=documents,
        top_n=top_n,
        return_documents=flags[0],
        input_order=flags[1],
        request_id=request_id,
    )
    try:
        response = stub.Rerank(request, timeout=60)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details(), request)
        fields = bad_request_fields(err)
        assert len(fields) == 1 and err.details().startswith(f"{fields[0]}: "), err.details()
        return
    assert len(response.results) == (min(top_n, len(documents)) if top_n else len(documents))


def test_the_cli_prints_one_line_per_document_best_first(
    server: ServerThread, stub: generate_pb2_grpc.GenerateServiceStub, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _edge_only(kind)
    from llmserve_client.cli import main

    assert main(["--address", server.address, "rerank", QUERY, *DOCUMENTS[:3], "--top-n", "2", "--documents"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS[:3], top_n=2), timeout=60).results
    assert [(line["index"], line["document"]) for line in lines] == [(r.index, DOCUMENTS[r.index]) for r in want]
    assert [line["score"] for line in lines] == pytest.approx([r.score for r in want], abs=1e-6)
