"""Tests for llmserve.engine.frontend.detokenizer: exact incremental text, held-back UTF-8, stop strings."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from llmserve.engine.frontend.detokenizer import DetokenizedDelta, IncrementalDetokenizer
from llmserve.models.gguf import convert_gguf, default_gguf_path

CORPUS = [
    "Hello world, this is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "world wide web; hello there, my friend!",
    "你好，世界。今天天气很好。",
    "Tokenizers split   spaces and\nnewlines too.",
] * 20
MIXED_TEXT = "你好，世界 🎉👍🏽 Hello world, naïve café — done."


class ByteTokenizer:
    """Ids are byte strings; decode concatenates them and decodes UTF-8 with replacement, like byte-level BPE."""

    def __init__(self, pieces: list[bytes], special: frozenset[int] = frozenset()) -> None:
        self.pieces = pieces
        self.special = special
        self.calls: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(token_ids))
        kept = [i for i in token_ids if not (skip_special_tokens and i in self.special)]
        return b"".join(self.pieces[i] for i in kept).decode("utf-8", errors="replace")

    def ids(self, *pieces: str | bytes) -> list[int]:
        out = []
        for piece in pieces:
            raw = piece.encode() if isinstance(piece, str) else piece
            if raw not in self.pieces:
                self.pieces.append(raw)
            out.append(self.pieces.index(raw))
        return out


def run(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[DetokenizedDelta], str]:
    """Push `ids` in chunks until a stop; return the deltas and the flushed tail ("" after a stop)."""
    deltas = []
    for i in range(0, len(ids), chunk):
        delta = detok.push(ids[i : i + chunk])
        deltas.append(delta)
        if delta.stop_sequence is not None:
            return deltas, detok.flush()
    return deltas, detok.flush()


def joined(deltas: list[DetokenizedDelta], tail: str) -> str:
    return "".join(d.text for d in deltas) + tail


def expected_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The reference: the text cut at the stop that completes first (earliest end, then longest)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, stop = min(hits, key=lambda h: (h[0], h[1]))
    return (text[:end] if include else text[:start]), stop


@pytest.fixture(scope="module")
def smol():
    """The SmolLM2 tokenizer (byte-level BPE), from the default model's converted folder."""
    return AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()), local_files_only=True)


def _sentencepiece_bpe() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: "▁" for spaces, a leading "▁" on the text, byte fallback for the rest."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _metaspace_unigram() -> PreTrainedTokenizerFast:
    """A T5/SentencePiece-Unigram-style tokenizer with the Metaspace pre-tokenizer and decoder."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>")
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


SENTENCEPIECE = {"bpe-byte-fallback": _sentencepiece_bpe(), "unigram-metaspace": _metaspace_unigram()}


# --- the decode it calls --------------------------------------------------------------------------------------


def test_fast_tokenizers_are_decoded_by_their_backend_and_others_by_their_own_decode(smol) -> None:
    """A transformers fast tokenizer without clean-up is decoded by its Rust backend (a quarter of the cost); one
    whose decode does more (clean-up, or an override) keeps its own decode, and the text follows it."""
    from llmserve.engine.frontend.detokenizer import _tokenizer_facts

    assert _tokenizer_facts(smol).decode.__name__ == "fast"
    for name in SENTENCEPIECE:
        assert _tokenizer_facts(SENTENCEPIECE[name]).decode.__name__ == "fast", name
    cleaning = _sentencepiece_bpe()
    cleaning.clean_up_tokenization_spaces = True
    assert _tokenizer_facts(cleaning).decode.__name__ == "slow"
    shouting = _sentencepiece_bpe()
    plain_decode = shouting.decode
    shouting.decode = lambda ids, skip_special_tokens=True: plain_decode(  # type: ignore[method-assign]
        ids, skip_special_tokens=skip_special_tokens
    ).upper()
    ids = shouting.encode("hello world, my friend")
    deltas, tail = run(IncrementalDetokenizer(shouting), ids)
    assert joined(deltas, tail) == "HELLO WORLD, MY FRIEND"


def _smol_decoding_specials_differently(skip: bool):  # noqa: ANN202
    """A fresh SmolLM2 tokenizer whose decode marks special tokens, only when skip_special_tokens is `skip`."""
    tok = AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()), local_files_only=True)
    plain, specials = tok.decode, set(tok.all_special_ids)

    def decode(ids, skip_special_tokens=True):  # noqa: ANN001, ANN202
        text = plain(ids, skip_special_tokens=skip_special_tokens)
        return text + "!" if skip_special_tokens == skip and any(i in specials for i in ids) else text

    tok.decode = decode
    return tok


@pytest.mark.parametrize("skip", [True, False])
def test_a_decode_that_differs_only_on_special_tokens_is_kept(skip: bool) -> None:
    """The probe puts a special token in every run and tries both ways of skipping them: a tokenizer whose own
    decode differs from its backend's only there keeps its own."""
    from llmserve.engine.frontend.detokenizer import _tokenizer_facts

    assert _tokenizer_facts(_smol_decoding_specials_differently(skip)).decode.__name__ == "slow"


def test_tokenizers_the_probe_cannot_vouch_for_keep_their_own_decode(smol) -> None:
    """A backend but no clean-up setting (unknown: treated as cleaning up), or no vocabulary to probe with."""
    from llmserve.engine.frontend.detokenizer import _tokenizer_facts

    class Bare:
        backend_tokenizer = smol.backend_tokenizer
        all_special_ids = smol.all_special_ids

        def get_vocab(self) -> dict[str, int]:
            return smol.get_vocab()

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return smol.decode(ids, skip_special_tokens=skip_special_tokens)

    class Empty(Bare):
        clean_up_tokenization_spaces = False

        def get_vocab(self) -> dict[str, int]:
            return {}

    for tokenizer in (Bare(), Empty()):
        assert _tokenizer_facts(tokenizer).decode.__name__ == "slow", type(tokenizer).__name__
    assert joined(*run(IncrementalDetokenizer(Bare()), smol.encode("hello world"))) == "hello world"


# --- exactness and UTF-8 ----------------------------------------------------------------------------------


@pytest.mark.real_model
def test_partial_utf8_is_held_back_with_the_real_tokenizer(smol) -> None:
    ids = smol.encode(MIXED_TEXT, add_special_tokens=False)
    assert any(smol.decode([i]) == "\ufffd" for i in ids), "expected tokens holding incomplete UTF-8"
    deltas, tail = run(IncrementalDetokenizer(smol), ids)
    assert all("\ufffd" not in d.text for d in deltas)
    assert joined(deltas, tail) == smol.decode(ids) == MIXED_TEXT


@pytest.mark.real_model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(0, 49151), max_size=40),
    chunk=st.integers(1, 3),
    skip_special=st.booleans(),
)
def test_concatenation_equals_decode_for_random_ids(smol, ids, chunk, skip_special) -> None:
    deltas, tail = run(IncrementalDetokenizer(smol, skip_special_tokens=skip_special), ids, chunk)
    assert joined(deltas, tail) == smol.decode(ids, skip_special_tokens=skip_special)


@pytest.mark.real_model
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60), chunk=st.integers(1, 3))
def test_concatenation_equals_decode_for_encoded_text(smol, text, chunk) -> None:
    ids = smol.encode(text, add_special_tokens=False)
    deltas, tail = run(IncrementalDetokenizer(smol), ids, chunk)
    assert joined(deltas, tail) == smol.decode(ids)
    if "\ufffd" not in smol.decode(ids):
        assert all("\ufffd" not in d.text for d in deltas)


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_sentencepiece_leading_spaces_and_byte_fallback(name: str) -> None:
    tok = SENTENCEPIECE[name]
    for text in [MIXED_TEXT, "  two leading spaces", "Hello world", "a  b   c\nd"]:
        ids = tok.encode(text, add_special_tokens=False)
        deltas, tail = run(IncrementalDetokenizer(tok), ids)
        assert joined(deltas, tail) == tok.decode(ids, skip_special_tokens=True)
        if "\ufffd" not in tok.decode(ids):
            assert all("\ufffd" not in d.text for d in deltas)


@pytest.mark.parametrize("name", SENTENCEPIECE)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), chunk=st.integers(1, 3), skip_special=st.booleans())
def test_sentencepiece_concatenation_equals_decode_for_random_ids(name, data, chunk, skip_special) -> None:
    tok = SENTENCEPIECE[name]
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=30))
    deltas, tail = run(IncrementalDetokenizer(tok, skip_special_tokens=skip_special), ids, chunk)
    assert joined(deltas, tail) == tok.decode(ids, skip_special_tokens=skip_special)


def test_decode_window_does_not_grow_with_the_generation() -> None:
    tok = ByteTokenizer([])
    ids = tok.ids("a", " b", "é".encode()[:1], "é".encode()[1:], " c") * 400
    expected = tok.decode(ids)
    tok.calls.clear()
    deltas, tail = run(IncrementalDetokenizer(tok, stop_sequences=["zzz"]), ids)
    assert max(tok.calls) <= 4
    assert joined(deltas, tail) == expected


def test_special_tokens_are_skipped_or_kept() -> None:
    tok = ByteTokenizer([b"<eos>"], special=frozenset({0}))
    ids = tok.ids("Hi") + [0] + tok.ids(" there")
    for skip in (True, False):
        deltas, tail = run(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert joined(deltas, tail) == tok.decode(ids, skip_special_tokens=skip)


# --- stop sequences ---------------------------------------------------------------------------------------


def test_stop_split_across_tokens() -> None:
    tok = ByteTokenizer([])
    detok = IncrementalDetokenizer(tok, stop_sequences=["world"])
    assert detok.push(tok.ids("hello ")).text == "hello "
    assert detok.push(tok.ids("wor")) == DetokenizedDelta("", None)  # could be the start of "world"
    assert detok.push(tok.ids("ld")) == DetokenizedDelta("", "world")
    assert detok.push(tok.ids(" more")) == DetokenizedDelta("", None)
    assert detok.flush() == ""
    assert detok.stopped_on == "world"


def test_stop_inside_one_token_with_text_after_it() -> None:
    tok = ByteTokenizer([])
    deltas, tail = run(IncrementalDetokenizer(tok, stop_sequences=["STOP"]), tok.ids("ab", "cdSTOPef", "gh"))
    assert [d.text for d in deltas] == ["ab", "cd"]
    assert deltas[-1].stop_sequence == "STOP" and tail == ""


def test_false_start_is_released() -> None:
    tok = ByteTokenizer([])
    detok = IncrementalDetokenizer(tok, stop_sequences=["world"])
    assert detok.push(tok.ids("wo")).text == ""
    assert detok.push(tok.ids("x")).text == "wox"
    assert detok.push(tok.ids(" w")).text == " "
    assert detok.flush() == "w"
    assert detok.stopped_on is None


def test_include_stop_sequence() -> None:
    tok = ByteTokenizer([])
    detok = IncrementalDetokenizer(tok, stop_sequences=["world"], include_stop_sequence=True)
    deltas, tail = run(detok, tok.ids("hello wo", "rld!!", "?"))
    assert joined(deltas, tail) == "hello world"
    assert deltas[-1].stop_sequence == "world"


def test_first_completed_stop_wins() -> None:
    tok = ByteTokenizer([])
    detok = IncrementalDetokenizer(tok, stop_sequences=["abcd", "bc", "d"])
    deltas, _ = run(detok, tok.ids("xabcd"))
    assert deltas[-1] == DetokenizedDelta("xa", "bc")


@pytest.mark.parametrize("stops", [["bc", "abc"], ["abc", "bc"]])
def test_stops_ending_together_the_longer_wins(stops: list[str]) -> None:
    tok = ByteTokenizer([])
    deltas, _ = run(IncrementalDetokenizer(tok, stop_sequences=stops), tok.ids("xabcy"))
    assert deltas[-1] == DetokenizedDelta("x", "abc")
    deltas, _ = run(IncrementalDetokenizer(tok, stop_sequences=stops, include_stop_sequence=True), tok.ids("xabcy"))
    assert deltas[-1] == DetokenizedDelta("xabc", "abc")


def test_stop_spanning_a_multibyte_character() -> None:
    tok = ByteTokenizer([])
    e_acute = "é".encode()
    ids = tok.ids("caf", e_acute[:1], e_acute[1:], " ok")
    deltas, tail = run(IncrementalDetokenizer(tok, stop_sequences=["fé"]), ids)
    assert joined(deltas, tail) == "ca" and deltas[-1].stop_sequence == "fé"


def test_stop_completed_by_the_flushed_tail() -> None:
    tok = ByteTokenizer([])
    # "b" arrives with the first byte of a character that never completes, so it is only certain at flush.
    detok = IncrementalDetokenizer(tok, stop_sequences=["ab"])
    assert detok.push(tok.ids("xa")).text == "x"
    assert detok.push(tok.ids(b"b\xc3")).text == ""
    assert detok.flush() == ""
    assert detok.stopped_on == "ab"


@pytest.mark.parametrize(("include", "expected"), [(False, ""), (True, "ab")])
def test_stop_completed_by_the_flushed_tail_with_or_without_the_stop(include: bool, expected: str) -> None:
    tok = ByteTokenizer([])
    detok = IncrementalDetokenizer(tok, stop_sequences=["ab"], include_stop_sequence=include)
    assert detok.push(tok.ids("xa")).text == "x"
    assert detok.push(tok.ids(b"b\xc3")).text == ""
    assert detok.flush() == expected and detok.stopped_on == "ab"


def test_only_byte_fallback_tokens_hold_text_back() -> None:
    """A six-character token that is not "<0x..>" is text like any other: it is emitted as soon as it is pushed."""
    tok = SENTENCEPIECE["bpe-byte-fallback"]
    words = [i for token, i in tok.get_vocab().items() if len(token) == 6 and not token.startswith("<0x")]
    assert words
    for i in words:
        assert IncrementalDetokenizer(tok).push([i]).text == tok.decode([i])
    byte = tok.convert_tokens_to_ids("<0x41>")
    detok = IncrementalDetokenizer(tok)
    assert detok.push([byte]).text == "" and detok.flush() == "A"  # a byte run stays open until it ends


def test_empty_stop_sequence_is_rejected() -> None:
    with pytest.raises(ValueError, match="^stop sequences must not be empty strings$"):
        IncrementalDetokenizer(ByteTokenizer([]), stop_sequences=["ok", ""])


@pytest.mark.real_model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunk=st.integers(1, 3), include=st.booleans())
def test_stops_cut_the_decode_exactly(smol, data, chunk, include) -> None:
    text = data.draw(st.sampled_from([MIXED_TEXT, "The capital of France is Paris. It is big.", "aaa bbb aaa"]))
    ids = smol.encode(text, add_special_tokens=False)
    full = smol.decode(ids)
    stops = data.draw(
        st.lists(
            st.one_of(
                st.tuples(st.integers(0, len(full) - 1), st.integers(1, 6)).map(lambda t: full[t[0] : t[0] + t[1]]),
                st.text(min_size=1, max_size=3),
            ),
            min_size=1,
            max_size=3,
        )
    )
    detok = IncrementalDetokenizer(smol, stop_sequences=stops, include_stop_sequence=include)
    deltas, tail = run(detok, ids, chunk)
    want, stop = expected_cut(full, stops, include)
    assert joined(deltas, tail) == want
    assert detok.stopped_on == stop
