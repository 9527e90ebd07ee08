"""The encoder's forward (models/encoder.py) with backends/pooling.py's mean pooling and normalization, against
the reference no one here wrote: SentenceTransformer(folder).encode on the packaged all-MiniLM-L6-v2, for 200 real
sentences of mixed length (tests/data/sentences.txt), float32, each sentence alone and in batches of mixed sizes,
with oneDNN-packed, plain and split (bf16x3, on AMX) linears; dimensions = 128 against sentence-transformers' own
truncate_dim."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from llmserve.engine.backends.cpu import split_linear
from llmserve.engine.backends.cpu.split_linear import Fp32Matmul
from llmserve.engine.backends.encoder_batch import EncoderBatch
from llmserve.engine.backends.pooling import finish, pool
from llmserve.engine.types.pooling import PoolingConfig, PoolingMode
from llmserve.models.encoder import BertEncoder, EncoderConfig
from llmserve.models.packaged import extract, find_packaged
from llmserve.models.pooling_config import read_pooling_config
from tests.testing import tiny_config

SENTENCES = Path(__file__).resolve().parents[1] / "data" / "sentences.txt"
# The acceptance bar of issue 44: float32 vectors within these of the reference.
MIN_COSINE = 0.99999
MAX_ABS = 1e-4


@pytest.fixture(scope="module")
def folder() -> Path:
    model = find_packaged("all-minilm-l6-v2")
    assert model is not None
    return extract(model)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    lines = SENTENCES.read_text(encoding="utf-8").splitlines()
    return lines[::10][:200]  # spread over the file: 3 to 75 words


@pytest.fixture(scope="module")
def sentence_transformer(folder: Path):  # type: ignore[no-untyped-def]
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def reference(sentence_transformer, texts: list[str]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return sentence_transformer.encode(texts, batch_size=32, convert_to_tensor=True).float()


@pytest.fixture(scope="module")
def token_ids(folder: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert max(len(s) for s in ids) <= 256  # no input reaches max_seq_length: sentence-transformers cut none
    return ids


@pytest.fixture(scope="module")
def pipeline(folder: Path) -> PoolingConfig:
    config = read_pooling_config(folder)
    assert config is not None and config.mode is PoolingMode.MEAN and config.normalize
    return config


@pytest.fixture(scope="module", params=["packed", "plain", "bf16x3"])
def encoder(request: pytest.FixtureRequest, folder: Path) -> BertEncoder:
    """oneDNN-packed float32 linears, F.linear, or three bfloat16 products on AMX tiles (where the CPU has them)."""
    if request.param == "bf16x3" and (missing := split_linear.why_unavailable()) is not None:
        pytest.skip(f"bf16x3 linears cannot run here: {missing}")
    config = EncoderConfig.of(json.loads((folder / "config.json").read_text()))
    matmul = Fp32Matmul.BF16X3 if request.param == "bf16x3" else Fp32Matmul.IEEE
    encoder = BertEncoder(
        config, load_file(str(folder / "model.safetensors")), pack=request.param == "packed", matmul=matmul
    )
    assert encoder.matmul is matmul
    return encoder


def _embed(
    encoder: BertEncoder, seqs: list[list[int]], pipeline: PoolingConfig, dims: int | None = None
) -> torch.Tensor:
    with torch.inference_mode():
        batch = EncoderBatch.pack(seqs)
        return finish(
            pool(encoder(batch), batch.seq_lens, pipeline.mode), dimensions=dims, normalize=pipeline.normalize
        )


def _assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape and ours.dtype == torch.float32
    cosine = F.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine.min().item()
    assert (ours - reference).abs().max().item() <= MAX_ABS


def test_each_sentence_alone(encoder, token_ids, pipeline, reference) -> None:  # type: ignore[no-untyped-def]
    ours = torch.cat([_embed(encoder, [seq], pipeline) for seq in token_ids])
    _assert_close(ours, reference)


def test_batches_of_mixed_sizes_and_lengths(encoder, token_ids, pipeline, reference) -> None:  # type: ignore[no-untyped-def]
    order = list(range(len(token_ids)))
    random.Random(44).shuffle(order)  # every batch mixes short and long sentences
    ours = torch.empty_like(reference)
    start = 0
    for size in (1, 7, 32, 64, 96):
        rows = order[start : start + size]
        ours[rows] = _embed(encoder, [token_ids[i] for i in rows], pipeline)
        start += size
    assert start == len(token_ids)
    _assert_close(ours, reference)


def test_dimensions_truncate_then_renormalize(encoder, token_ids, pipeline, sentence_transformer, texts) -> None:  # type: ignore[no-untyped-def]
    truncated = sentence_transformer.encode(
        texts, batch_size=32, convert_to_tensor=True, truncate_dim=128, normalize_embeddings=True
    ).float()
    ours = _embed(encoder, token_ids[:100], pipeline, dims=128)
    ours = torch.cat([ours, _embed(encoder, token_ids[100:], pipeline, dims=128)])
    assert ours.shape == (200, 128)
    _assert_close(ours, truncated)
    assert torch.allclose(ours.norm(dim=-1), torch.ones(200), atol=1e-6)


def test_the_forward_equals_transformers_hidden_states(encoder, folder, token_ids) -> None:  # type: ignore[no-untyped-def]
    """Every token's hidden state, not only the pooled vector: transformers' BertModel over a padded batch."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()
    # As they come (runs of any lengths), and shortest first as the backend packs them (groups of like length).
    for seqs in (token_ids[:24], sorted(token_ids[:24], key=len)):
        ours, expected = _ours_and_transformers(encoder, model, seqs)
        assert (ours - expected).abs().max().item() <= 1e-4


def _ours_and_transformers(
    encoder: BertEncoder, model: Any, seqs: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's final hidden state, packed: the encoder's, and transformers' BertModel's over the padded batch
    with its attention mask."""
    longest = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (longest - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in seqs])
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        return encoder(EncoderBatch.pack(seqs)), expected


def test_token_types_and_a_sequence_over_the_positions(encoder: BertEncoder) -> None:
    seq = [101, 2023, 2003, 102, 2008, 102]
    with torch.inference_mode():
        plain = encoder(EncoderBatch.pack([seq]))
        zeros = encoder(EncoderBatch.pack([seq], token_type_ids=[[0] * 6]))
        pair = encoder(EncoderBatch.pack([seq], token_type_ids=[[0, 0, 0, 0, 1, 1]]))
    assert torch.equal(plain, zeros) and not torch.allclose(plain[4:], pair[4:])
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        encoder(EncoderBatch.pack([[101] * 513]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "not a served encoder"),
        ({"hidden_act": "swish"}, "hidden_act"),
        ({"position_embedding_type": "relative_key"}, "absolute"),
        ({"num_attention_heads": 7}, "multiple"),
    ],
)
def test_configs_not_served_are_refused(folder: Path, change: dict[str, object], message: str) -> None:
    config = json.loads((folder / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=message):
        EncoderConfig.of(config)


@pytest.mark.parametrize("activation", ["gelu", "gelu_new", "relu"])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
def test_each_activation_a_config_may_name(activation: str, pack: bool) -> None:
    """A small random BERT of each served activation gives transformers' hidden states (weights large enough
    that the erf and tanh GELUs differ beyond the tolerance)."""
    from transformers import BertModel

    torch.manual_seed(7)
    config = tiny_config("bert", vocab_size=50, max_positions=64, hidden_act=activation, initializer_range=0.5)
    model = BertModel(config, add_pooling_layer=False).eval()
    encoder = BertEncoder.from_model(model, pack=pack)
    ours, expected = _ours_and_transformers(encoder, model, [[2, 5, 9, 3], [4, 7, 1, 8, 8, 2, 6], [3]])
    assert (ours - expected).abs().max().item() <= 1e-5
