"""Tests for llmserve.models.gguf_model: a model built over a GGUF's blocks holds the file's weights, in the Hugging
Face layout (llama.cpp's q/k permutation undone by row order), without a float copy; what it cannot serve is refused
naming the file, the tensor and its type."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from llmserve.engine.backends.cpu import quant
from llmserve.engine.backends.cpu.gguf_linear import QuantProjection
from llmserve.models.gguf_file import GGUFError, GGUFFile
from llmserve.models.gguf_model import QuantEmbedding, build_model
from llmserve.models.loader import from_config, load_model
from tests.gguf_helpers import LINEARS, Q, round_trip, write_llama_gguf
from tests.testing import tiny_config

# q/k in one type, v in another (as Q4_K_M files mix Q4_K and Q6_K), the rest in a third.
KINDS = {
    f"blk.{i}.{n}.weight": k for i in range(2) for n, k in (("attn_q", Q.Q4_0), ("attn_k", Q.Q4_0), ("attn_v", Q.Q4_1))
}


def source_model(tied: bool = True):  # noqa: ANN201 - a transformers LlamaForCausalLM
    config = tiny_config("llama")
    config.tie_word_embeddings = tied
    return from_config(config, dtype=torch.float32, seed=4).model


@pytest.mark.parametrize("tied", [True, False])
def test_each_projection_holds_the_files_weights_in_the_hugging_face_layout(tmp_path: Path, tied: bool) -> None:
    source = source_model(tied)
    path = write_llama_gguf(tmp_path / "tiny.gguf", source, KINDS)
    model = build_model(GGUFFile.open(path), source.config)
    state = source.state_dict()
    for i, layer in enumerate(model.model.layers):
        for hf, cpp in LINEARS.items():
            parent, name = hf.split(".")
            projection = getattr(getattr(layer, parent), name)
            assert isinstance(projection, QuantProjection)
            weights = quant.dequantize(projection.weight_blocks)
            if projection.order is not None:
                weights = weights[projection.order]
            expected = round_trip(state[f"model.layers.{i}.{hf}.weight"], KINDS.get(f"blk.{i}.{cpp}.weight", Q.Q8_0))
            assert torch.equal(weights, expected), f"layer {i} {hf}"
        assert torch.equal(layer.input_layernorm.weight, state[f"model.layers.{i}.input_layernorm.weight"])
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    head = model.lm_head
    assert head.source == ("token_embd.weight" if tied else "output.weight")
    expected_head = round_trip(state["lm_head.weight"], Q.Q8_0)
    assert torch.equal(quant.dequantize(head.weight_blocks), expected_head)
    # Nothing but the norms is a float parameter: the weights are the file's blocks.
    assert sum(p.numel() for p in model.parameters()) == 64 * (2 * 2 + 1)


def test_its_own_forward_is_the_dequantized_models_within_activation_rounding(tmp_path: Path) -> None:
    source = source_model()
    path = write_llama_gguf(tmp_path / "tiny.gguf", source, KINDS)
    model = build_model(GGUFFile.open(path), source.config)
    reference = source_model()  # the same weights as the file holds them, in float32
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("proj.weight") or name == "model.embed_tokens.weight":
                layer = name.split(".")
                cpp = "token_embd" if "embed" in name else LINEARS[".".join(layer[3:5])]
                key = "token_embd.weight" if "embed" in name else f"blk.{layer[2]}.{cpp}.weight"
                param.copy_(round_trip(param, KINDS.get(key, Q.Q8_0)))
    ids = torch.tensor([[5, 17, 300, 2, 9, 44, 511, 128]])
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    # The kernels quantize each input row per block of 32 (quant.py): the logits move by a fraction of their spread.
    assert (ours - theirs).abs().max() < 0.02 * theirs.abs().max()
    assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()


def mapped_pages(file: GGUFFile, name: str) -> int:
    """How many whole pages of tensor `name` this process maps now (/proc/self/pagemap's present bit, readable
    without privileges)."""
    page = mmap.PAGESIZE
    start = file.blocks(name).data_ptr()
    first, last = -(-start // page), (start + file.info(name).nbytes) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first) * 8)
    return sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))


def test_an_embedding_lookup_reads_the_file_without_mapping_its_pages(tmp_path: Path) -> None:
    # A tied LM head holds the embedding's blocks packed in its kernel: rows read through the mapping would count
    # them twice in the resident set (the 1B shape's 210-280 MB). Read with pread, the pages stay in the page cache.
    source = source_model()
    file = GGUFFile.open(write_llama_gguf(tmp_path / "tiny.gguf", source, KINDS))
    embedding = build_model(file, source.config).model.embed_tokens
    assert file.info("token_embd.weight").nbytes >= 3 * mmap.PAGESIZE, "too small to hold a whole page"
    file.release(["token_embd.weight"])
    ids = torch.tensor([[5, 100, 5], [source.config.vocab_size - 1, 200, 300]])  # rows on whole pages too
    rows = embedding(ids)
    assert mapped_pages(file, "token_embd.weight") == 0
    assert torch.equal(rows, quant.dequantize(embedding.weight_blocks)[ids])  # (this reads through the mapping)
    with pytest.raises(IndexError, match="row ids must lie in"):
        embedding(torch.tensor([source.config.vocab_size]))


def test_a_block_type_the_kernels_do_not_compute_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    source = source_model()
    q2k = np.zeros((2, 84), dtype=np.uint8)  # two rows of 256 weights in Q2_K's 84-byte blocks
    path = write_llama_gguf(tmp_path / "mixed.gguf", source, extra={"blk.0.attn_extra.weight": (Q.Q2_K, q2k)})
    with pytest.raises(
        GGUFError, match=r"mixed\.gguf: tensor blk\.0\.attn_extra\.weight holds Q2_K blocks.*--dtype float32"
    ):
        build_model(GGUFFile.open(path), source.config)


def test_an_architecture_it_does_not_serve_is_refused(tmp_path: Path) -> None:
    source = source_model()
    path = write_llama_gguf(tmp_path / "other.gguf", source, arch="gptneox")
    with pytest.raises(GGUFError, match=r"other\.gguf: architecture 'gptneox' is not served from its blocks"):
        build_model(GGUFFile.open(path), source.config)


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    source = source_model()
    path = write_llama_gguf(tmp_path / "tiny.gguf", source)
    config = source.config
    config.num_hidden_layers = 3  # the file has two
    with pytest.raises(GGUFError, match=r"tiny\.gguf: no tensor 'blk\.2\.attn_q\.weight'"):
        build_model(GGUFFile.open(path), config)


@pytest.mark.real_model
def test_the_default_model_loads_from_its_blocks_and_a_second_start_reads_the_cache(tmp_path: Path) -> None:
    loaded = load_model(None, device="cpu", dtype="auto", cache_root=tmp_path)
    assert loaded.weights == "gguf" and loaded.gguf is not None
    assert loaded.mapped_bytes == loaded.gguf.tensor_bytes < 100 << 20
    assert sum(p.numel() for p in loaded.model.parameters()) == 576 * (2 * 30 + 1)  # the norms only
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template
    assert loaded.eos_token_ids == (2,)
    folder = tmp_path / "SmolLM2-135M-Instruct.Q4_1.config"
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json", "llmserve.json"} <= set(stamps)
    assert not (tmp_path / "SmolLM2-135M-Instruct.Q4_1").exists(), "no float conversion"
    started = time.monotonic()
    again = load_model(None, device="cpu", dtype="gguf", cache_root=tmp_path)
    assert time.monotonic() - started < 5.0  # the cached tokenizer and config, the file mapped (~10 s uncached)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert again.shape == loaded.shape


def test_dtype_gguf_needs_a_gguf_file_on_the_cpu() -> None:
    with pytest.raises(ValueError, match="dtype gguf serves a .gguf file on the CPU"):
        load_model("random:tiny", device="cpu", dtype="gguf")
