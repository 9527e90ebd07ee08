"""Rerank at the edge: the call's checks, its (query, document) pairs tokenized as sentence-transformers' CrossEncoder
tokenizes them, and the classifier's logits turned into ordered results.

A pair is one input of the classifier: the tokenizer's text-pair encoding (BERT: [CLS] query [SEP] document [SEP],
segment ids 0 for the query's part and 1 for the document's), cut to the model's length as the tokenizer's
`truncation="longest_first"` cuts it, which is what CrossEncoder.predict feeds its model (on 180 random pairs of
lengths and limits, the same ids and segments: tests/api/test_rerank.py). The engine runs each pair as a pooling
request with its segment ids (types/request.GenerationRequest.token_type_ids), batched with Embed's inputs; its final
vector is the head's logits. The servicer (servicer.py) admits, sends and gathers the call as it does an Embed call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmserve.api.convert import probabilities
from llmserve.api.limits import check_id, check_prompt_bytes, cut_utf8, truncation_byte_bound
from llmserve.config import InputLimits
from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.request import GenerationRequest, PoolingParams, StoppingParams
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb

__all__ = [
    "Pair",
    "PairTemplate",
    "check_rerank",
    "longest_first",
    "pair_limit",
    "pair_request",
    "pair_template",
    "rerank_pairs",
    "rerank_results",
]


# Tokens of a document's byte cut beyond what longest_first may keep, so that the word the cut split (tokenized
# otherwise than in the whole document) is never kept.
CUT_MARGIN = 16


@dataclass(frozen=True, slots=True)
class Pair:
    """One (query, document) pair as the model reads it: its token ids, their segments (empty when the tokenizer
    marks none: all segment 0) and whether truncation cut it."""

    token_ids: list[int]
    token_type_ids: list[int]
    truncated: bool


def check_rerank(request: pb.RerankRequest, limits: InputLimits, max_prompt_bytes: int) -> None:
    """The sizes and ranges of a Rerank call, before any tokenizer or engine work: a query within --max-prompt-bytes,
    at least one document and at most --max-embed-inputs, none empty; top_n >= 0. A document is never refused for its
    size: every pair is truncated, and a document is cut at truncation_byte_bound before tokenizing (rerank_pairs)."""
    check_id("request_id", request.request_id, limits.max_request_id_length, "--max-request-id-length")
    if not request.query:
        raise InvalidRequest("query", "must not be empty")
    check_prompt_bytes("query", request.query, max_prompt_bytes)
    documents = request.documents
    if not documents:
        raise InvalidRequest("documents", "must not be empty")
    if len(documents) > limits.max_embed_inputs:
        raise InvalidRequest(
            "documents", f"has {len(documents)} documents, the limit is {limits.max_embed_inputs} (--max-embed-inputs)"
        )
    for i, document in enumerate(documents):
        if not document:
            raise InvalidRequest(f"documents[{i}]", "must not be empty")
    if request.top_n < 0:
        raise InvalidRequest("top_n", f"must be >= 0, got {request.top_n}")


def pair_limit(tokenizer: Any, max_input_tokens: int) -> int:
    """The most tokens of one pair: the tokenizer's model_max_length (CrossEncoder's max length), within what the
    server takes of one pooling input."""
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < max_input_tokens:
        return declared
    return max_input_tokens


def rerank_pairs(tokenizer: Any, query: str, documents: Sequence[str], limit: int, lower: bool) -> list[Pair]:
    """Every (query, document) pair's tokens, cut to `limit` tokens longest_first as CrossEncoder cuts them (on a
    worker thread: it tokenizes); `lower`: the texts lowercased first, as the folder's sentence-transformers
    configuration asks.

    The texts are encoded on their own, without special tokens, and the pair is put together here (the tokenizer's
    pair template, `pair_template`) and cut as the tokenizers library cuts it (`longest_first`): a fast tokenizer's
    truncation is a setting of the shared Rust object, which a concurrent call (an Embed call's, which truncates
    nothing) would change under this one's feet.
    """

    def fold(text: str) -> str:
        return text.lower() if lower else text

    # What truncation keeps of a long document lies within its first bytes (as an Embed text's with truncate set):
    # only those are tokenized. The pair is the whole document's wherever the cut holds more tokens than the room and
    # the query (longest_first then keeps the same first tokens of the document, and a word the cut split lies past
    # CUT_MARGIN of them); a document whose first bytes hold fewer (long runs of symbols, or a longer query) is
    # tokenized whole.
    cuts = [cut_utf8(document, truncation_byte_bound(limit), keep_end=False) for document in documents]
    texts = [fold(query), *(fold(text) for text, _ in cuts)]
    encoded: list[list[int]] = tokenizer(texts, add_special_tokens=False)["input_ids"]
    own_query, own_documents = encoded[0], encoded[1:]
    template = pair_template(tokenizer)
    room = max(limit - template.added, 0)
    short = [
        j
        for j, (ids, (_, was_cut)) in enumerate(zip(own_documents, cuts, strict=True))
        if was_cut and len(ids) < max(room, len(own_query)) + CUT_MARGIN
    ]
    if short:
        whole = [fold(documents[j]) for j in short]
        for j, ids in zip(short, tokenizer(whole, add_special_tokens=False)["input_ids"], strict=True):
            own_documents[j] = ids
    pairs = []
    for own_document, (_, was_cut) in zip(own_documents, cuts, strict=True):
        kept = longest_first(len(own_query), len(own_document), room)
        cut = was_cut or kept != (len(own_query), len(own_document))
        pairs.append(template.pair(own_query[: kept[0]], own_document[: kept[1]], cut))
    return pairs


def longest_first(first: int, second: int, room: int) -> tuple[int, int]:
    """How many tokens of each of a pair's two texts (`first` and `second` long) to keep within `room`, as the
    tokenizers library's LongestFirst truncation keeps them: the longer text is cut first, down to the shorter one's
    length; then both to half the room (the longer keeps the odd token)."""
    if first + second <= room:
        return first, second
    short, long = sorted((first, second))
    keep_short, keep_long = short, max(short, room - short)
    if keep_short + keep_long > room:
        keep_short, keep_long = room // 2, room // 2 + room % 2
    return (keep_long, keep_short) if first > second else (keep_short, keep_long)


@dataclass(frozen=True, slots=True)
class PairTemplate:
    """Where a tokenizer puts its special tokens around a text pair (BERT: [CLS] a [SEP] b [SEP]) and the segment of
    each part, read off one encoded pair."""

    before: list[int]
    between: list[int]
    after: list[int]
    types: tuple[list[int], int, list[int], int, list[int]] | None  # the parts' segments; None: no segment ids

    @property
    def added(self) -> int:
        return len(self.before) + len(self.between) + len(self.after)

    def pair(self, first: list[int], second: list[int], truncated: bool) -> Pair:
        ids = [*self.before, *first, *self.between, *second, *self.after]
        types: list[int] = []
        if self.types is not None:
            before, first_type, between, second_type, after = self.types
            types = [*before, *[first_type] * len(first), *between, *[second_type] * len(second), *after]
        return Pair(ids, types, truncated)


def pair_template(tokenizer: Any) -> PairTemplate:
    """The tokenizer's PairTemplate (ValueError when its pair encoding does not hold the two texts' own tokens)."""
    a, b = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("a", "b"))
    encoded = tokenizer("a", "b")
    ids: list[int] = encoded["input_ids"]
    types: list[int] | None = encoded.get("token_type_ids")
    for i in range(len(ids) - len(a) + 1):
        if ids[i : i + len(a)] != a:
            continue
        for j in range(i + len(a), len(ids) - len(b) + 1):
            if ids[j : j + len(b)] == b:
                k = j + len(b)
                parts = None
                if types is not None:
                    parts = (types[:i], types[i], types[i + len(a) : j], types[j], types[k:])
                return PairTemplate(ids[:i], ids[i + len(a) : j], ids[k:], parts)
    raise ValueError("the tokenizer's pair encoding does not hold the two texts")


def pair_request(
    request: pb.RerankRequest,
    index: int,
    pair: Pair,
    *,
    request_id: str,
    pooling: PoolingParams,
    deadline: float | None = None,
) -> GenerationRequest:
    """The engine's request for pair `index` of a Rerank call (its own id: `request_id/index`): prefill only, with
    the pair's segments."""
    return GenerationRequest(
        deadline=deadline,
        request_id=f"{request_id}/{index}",
        prompt_token_ids=tuple(pair.token_ids),
        stopping=StoppingParams(max_new_tokens=1),
        priority=request.priority,
        prompt_field=f"documents[{index}]",
        pooling=pooling,
        token_type_ids=tuple(pair.token_type_ids),
    )


def rerank_results(
    request: pb.RerankRequest, pairs: Sequence[Pair], logits: Sequence[Sequence[float]], prompt_tokens: Sequence[int]
) -> list[pb.RerankResult]:
    """The call's results from each pair's logits, best first (ties in the documents' order) or in the documents'
    order as the request asks, the top_n best only when it sets top_n."""
    results = []
    for i, (pair, values) in enumerate(zip(pairs, logits, strict=True)):
        probs = probabilities(values)
        results.append(
            pb.RerankResult(
                index=i,
                score=probs[-1],
                document=request.documents[i] if request.return_documents else "",
                prompt_tokens=prompt_tokens[i],
                truncated=pair.truncated,
                logits=values,
                probabilities=probs,
            )
        )
    # Ranked on the float32 scores the caller reads, so that the order agrees with the values returned.
    best = sorted(results, key=lambda r: -r.score)  # stable: ties keep the documents' order
    if request.top_n:
        best = best[: request.top_n]
    if request.input_order:
        best.sort(key=lambda r: r.index)
    return best
