"""pooling.py: each pooling mode over packed rows against a plain per-sequence reduction (hypothesis), the same
over chunks (a decoder's chunked prefill), truncation and normalization; and every mode with Dense projections
against sentence-transformers itself, on pipelines its own writer saved around the packaged all-MiniLM-L6-v2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from llmserve.engine.backends.encoder_batch import EncoderBatch
from llmserve.engine.backends.pooling import DenseStack, PoolingState, finish, pool
from llmserve.engine.types.pooling import DenseModule, PoolingMode
from llmserve.models.encoder import BertEncoder, EncoderConfig
from llmserve.models.packaged import extract, find_packaged
from llmserve.models.pooling_config import read_pooling_config

SENTENCES = Path(__file__).resolve().parents[2] / "data" / "sentences.txt"
MODES = list(PoolingMode)


def _naive(rows: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    if mode is PoolingMode.CLS:
        return rows[0]
    if mode is PoolingMode.LAST:
        return rows[-1]
    if mode is PoolingMode.MEAN:
        return rows.double().mean(0).to(rows.dtype)
    return rows.max(0).values


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    mode=st.sampled_from(MODES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_pool_is_a_per_sequence_reduction(lens: list[int], mode: PoolingMode, dtype: torch.dtype, seed: int) -> None:
    hidden = torch.randn(sum(lens), 5, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = pool(hidden, lens, mode)
    assert out.shape == (len(lens), 5) and out.dtype == dtype
    start = 0
    for i, n in enumerate(lens):
        expected = _naive(hidden[start : start + n], mode)
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out[i].float(), expected.float(), atol=tolerance), (i, mode)
        start += n


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 7), min_size=1, max_size=6),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_chunked_pooling_equals_pooling_at_once(cuts: list[int], mode: PoolingMode, seed: int) -> None:
    hidden = torch.randn(sum(cuts), 6, generator=torch.Generator().manual_seed(seed))
    state = PoolingState(mode)
    start = 0
    for n in cuts:
        state.add(hidden[start : start + n])
        start += n
    assert state.rows == len(hidden)
    assert torch.allclose(state.result(), pool(hidden, [len(hidden)], mode)[0], atol=1e-6)


def test_chunked_mean_accumulates_in_float32() -> None:
    # 600 rows of bfloat16 1.0 and one 3.0: a bfloat16 running sum would stall at 256 (8 significant bits).
    state = PoolingState(PoolingMode.MEAN)
    for _ in range(600):
        state.add(torch.ones(1, 2, dtype=torch.bfloat16))
    state.add(torch.full((1, 2), 3.0, dtype=torch.bfloat16))
    assert torch.allclose(state.result(), torch.full((2,), 603.0 / 601))
    assert state.result(torch.bfloat16).dtype == torch.bfloat16


def test_pooling_state_refuses_what_is_not_a_chunk() -> None:
    state = PoolingState(PoolingMode.LAST)
    with pytest.raises(ValueError, match="no chunk"):
        state.result()
    with pytest.raises(ValueError, match="rows >= 1"):
        state.add(torch.zeros(0, 4))


def test_pool_refuses_inconsistent_lengths() -> None:
    with pytest.raises(ValueError, match="add up to 3 rows"):
        pool(torch.zeros(4, 2), [1, 2], PoolingMode.MEAN)
    with pytest.raises(ValueError, match="at least one row"):
        pool(torch.zeros(2, 2), [2, 0], PoolingMode.MEAN)


def test_finish_truncates_then_normalizes() -> None:
    vectors = torch.tensor([[3.0, 4.0, 12.0], [0.0, 0.0, 5.0]])
    assert torch.equal(finish(vectors), vectors)
    assert torch.allclose(finish(vectors, normalize=True), vectors / torch.tensor([[13.0], [5.0]]))
    assert torch.allclose(finish(vectors, dimensions=2, normalize=True), torch.tensor([[0.6, 0.8], [0.0, 0.0]]))
    assert torch.equal(finish(vectors, dimensions=1), vectors[:, :1])
    for bad in (0, 4, -1):
        with pytest.raises(ValueError, match="dimensions must be in \\[1, 3\\]"):
            finish(vectors, dimensions=bad)


def test_dense_weights_are_checked(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"linear.weight": torch.zeros(4, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="config says \\(4, 6\\)"):
        DenseStack.load([DenseModule(tmp_path, 6, 4, False, "identity")])
    with pytest.raises(ValueError, match="no linear.bias"):
        DenseStack.load([DenseModule(tmp_path, 8, 4, True, "identity")])
    with pytest.raises(ValueError, match="no model.safetensors"):
        DenseStack.load([DenseModule(tmp_path / "nowhere", 8, 4, True, "identity")])
    torch.save({"linear.weight": torch.eye(2), "linear.bias": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    stack = DenseStack.load([DenseModule(tmp_path, 2, 2, True, "relu")])
    assert torch.equal(stack(torch.tensor([[-3.0, 2.0]])), torch.tensor([[0.0, 3.0]]))


@pytest.fixture(scope="module")
def minilm() -> Path:
    model = find_packaged("all-minilm-l6-v2")
    assert model is not None
    return extract(model)


@pytest.mark.parametrize(("mode", "st_mode"), [("cls", "cls"), ("last", "lasttoken"), ("max", "max"), ("mean", "mean")])
def test_every_mode_with_dense_equals_sentence_transformers(
    tmp_path: Path, minilm: Path, mode: str, st_mode: str
) -> None:
    """A pipeline sentence-transformers saves (pooling, two Dense projections, Normalize), read back by
    models/pooling_config.py and computed by the encoder, pooling and DenseStack, against the library's encode."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(0)  # the Dense weights
    modules = [
        Transformer(str(minilm)),
        Pooling(384, pooling_mode=st_mode),  # type: ignore[arg-type]
        Dense(384, 192),
        Dense(192, 96, bias=False, activation_function=torch.nn.GELU()),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    saved = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    texts = SENTENCES.read_text(encoding="utf-8").splitlines()[::50][:40]
    reference = saved.encode(texts, batch_size=16, convert_to_tensor=True).float()

    config = read_pooling_config(tmp_path / "st")
    assert config is not None and config.mode is PoolingMode.parse(mode) and config.embedding_size == 96
    encoder = BertEncoder(
        EncoderConfig.of(json.loads((tmp_path / "st" / "config.json").read_text())),
        load_file(str(tmp_path / "st" / "model.safetensors")),
    )
    dense = DenseStack.load(config.dense)
    tokenizer = saved.tokenizer
    with torch.inference_mode():
        batch = EncoderBatch.pack([tokenizer(t)["input_ids"] for t in texts])
        ours = finish(dense(pool(encoder(batch), batch.seq_lens, config.mode)), normalize=config.normalize)
    assert ours.shape == reference.shape == (40, 96)
    assert F.cosine_similarity(ours, reference).min().item() >= 0.99999
    assert (ours - reference).abs().max().item() <= 1e-4
