"""Tests for llmserve.models.gguf_file: the header parsed as the gguf package reads it, tensors as views of the mapped
file, and a clear error naming the file for a truncated, corrupt or foreign one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from llmserve.models.gguf import default_gguf_path
from llmserve.models.gguf_file import GGUFError, GGUFFile


@pytest.fixture(scope="module")
def default_file() -> GGUFFile:
    return GGUFFile.open(default_gguf_path())


def test_the_header_and_the_tensors_agree_with_the_gguf_packages_reader(default_file: GGUFFile) -> None:
    reader = GGUFReader(default_file.path)
    assert [t.name for t in reader.tensors] == list(default_file.tensors)
    for tensor in reader.tensors:
        info = default_file.info(tensor.name)
        assert (info.kind, info.dims, info.offset, info.nbytes) == (
            int(tensor.tensor_type),
            tuple(int(d) for d in tensor.shape),
            tensor.data_offset,
            tensor.n_bytes,
        )
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        expected = np.asarray(reader.get_tensor(list(default_file.tensors).index(name)).data).view(np.uint8)
        assert np.array_equal(default_file.blocks(name).numpy().reshape(-1), expected.reshape(-1))
    for key in ("general.architecture", "llama.block_count", "llama.attention.head_count_kv", "llama.rope.freq_base"):
        assert default_file.metadata.get(key) == reader.fields[key].contents()
    assert default_file.metadata.array_lengths["tokenizer.ggml.tokens"] == 49152
    assert default_file.architecture == "llama"
    assert default_file.tensor_bytes == sum(t.n_bytes for t in reader.tensors)


def test_norms_read_as_float32_and_block_views_survive_a_release(default_file: GGUFFile) -> None:
    norm = default_file.floats("blk.3.attn_norm.weight")
    assert norm.dtype == torch.float32 and norm.shape == (576,)
    blocks = default_file.blocks("blk.3.ffn_up.weight")
    before = blocks.clone()
    default_file.release(["blk.3.ffn_up.weight"])  # the pages leave this process's mapping, not the file
    assert torch.equal(blocks, before)


def test_a_truncated_file_names_the_file_and_the_tensor_it_cuts(tmp_path: Path) -> None:
    source = default_gguf_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source[: len(source) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf: truncated: tensor .* ends at byte"):
        GGUFFile.open(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(source[:5000])  # cut inside the tokenizer's strings
    with pytest.raises(GGUFError, match=r"header\.gguf: truncated or corrupt header"):
        GGUFFile.open(header_only)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"PK\x03\x04" + bytes(100), r"not a GGUF file \(it starts with"),
        (b"GGUF" + (1).to_bytes(4, "little") + bytes(100), "GGUF version 1"),
        (b"GG", r"not a GGUF file \(2 bytes\)"),
        # version 3, one tensor, one key whose value type (77) does not exist
        (b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (1).to_bytes(8, "little")
         + (1).to_bytes(8, "little") + b"k" + (77).to_bytes(4, "little") + bytes(64), "metadata value type 77"),
    ],
)  # fmt: skip
def test_a_foreign_or_corrupt_file_is_refused_naming_it(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=message) as raised:
        GGUFFile.open(path)
    assert str(path) in str(raised.value)


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        GGUFFile.open(tmp_path / "absent.gguf")
