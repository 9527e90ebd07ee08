"""api/tokenizer_files.py on its own, with SmolLM2's real tokenizer: the four files a gateway builds its tokenizer from
(they tokenize and render the chat template as the server does, and carry the BOS and EOS ids), a zip of them whose
bytes depend on the files alone, its chunks with the digest on the last, and the bundle built once per server (again
after a failed build) and removed on close. GetTokenizer through a server: tests/service/test_vllm_servicer.py."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from llmserve.api.tokenizer_files import CHUNK_BYTES, FILES, TokenizerBundle, chunks, write_files, zip_folder

EOS = (2, 7)


@pytest.fixture(scope="module")
def written(smollm_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer-files")
    write_files(smollm_tokenizer, EOS, folder)
    return folder


def test_the_files_tokenize_and_render_the_chat_template_as_the_server_does(
    smollm_tokenizer: Any, written: Path
) -> None:
    assert sorted(p.name for p in written.iterdir()) == sorted(FILES)
    theirs = AutoTokenizer.from_pretrained(written, local_files_only=True)
    text = "Once upon a time, naïve café owners said: «hello» 123"
    assert theirs.encode(text) == smollm_tokenizer.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ours = smollm_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ours
    config = json.loads((written / "tokenizer_config.json").read_text())
    assert config["chat_template"] == smollm_tokenizer.chat_template
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((written / name).read_text())
        assert ids == {"bos_token_id": smollm_tokenizer.bos_token_id, "eos_token_id": list(EOS)}


def test_the_zip_holds_the_files_at_its_root_and_its_bytes_depend_on_them_alone(written: Path, tmp_path: Path) -> None:
    data = zip_folder(written)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.namelist() == list(FILES)
        assert all(archive.read(name) == (written / name).read_bytes() for name in FILES)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in FILES:
        (copy / name).write_bytes((written / name).read_bytes())
    assert zip_folder(copy) == data  # another folder, other file times: the same bytes


def test_chunks_cover_the_zip_in_order_with_the_digest_on_the_last_only() -> None:
    data = bytes(range(256)) * (CHUNK_BYTES // 256 * 2 + 3)  # two full chunks and a part
    digest = hashlib.sha256(data).hexdigest()
    parts = list(chunks(data, digest))
    assert [len(b) for b, _ in parts] == [CHUNK_BYTES, CHUNK_BYTES, len(data) - 2 * CHUNK_BYTES]
    assert b"".join(b for b, _ in parts) == data
    assert [d for _, d in parts] == ["", "", digest]
    assert list(chunks(b"x", "d")) == [(b"x", "d")]


def test_the_bundle_is_built_once_again_after_a_failure_and_removed_on_close(smollm_tokenizer: Any) -> None:
    async def body() -> None:
        bundle = TokenizerBundle()
        with pytest.raises(AttributeError):
            await bundle.get(None, EOS)  # no tokenizer to save: the build fails
        first, second = await asyncio.gather(bundle.get(smollm_tokenizer, EOS), bundle.get(smollm_tokenizer, EOS))
        assert first is second and (await bundle.get(smollm_tokenizer, EOS)) is first
        assert first.sha256 == hashlib.sha256(first.zip_bytes).hexdigest()
        assert sorted(p.name for p in first.folder.iterdir()) == sorted(FILES)
        bundle.close()
        assert not first.folder.exists()

    asyncio.run(body())
