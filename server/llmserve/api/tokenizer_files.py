"""The served model's tokenizer as files a gateway can load: `tokenizer.json`, `tokenizer_config.json` (with the chat
template), `config.json` and `generation_config.json` (the BOS and EOS ids), in a folder and as a zip of it, for the
vLLM protocol's GetModelInfo (`tokenizer_path`) and GetTokenizer (smg builds its own tokenizer from them, applies
the chat template and detokenizes the ids the server returns).

The files are written once, on a worker thread, from the tokenizer the server loaded, so that the gateway
tokenizes exactly as llmserve's own Generate does. The zip's SHA-256 travels with its last chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import shutil
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# smg reads 64 KiB chunks; the protocol does not bound them, gRPC's 4 MiB message limit does.
CHUNK_BYTES = 64 * 1024
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")


@dataclass(slots=True, frozen=True)
class TokenizerFiles:
    folder: Path
    zip_bytes: bytes
    sha256: str  # hex, of zip_bytes


def write_files(tokenizer: Any, eos_token_ids: Sequence[int], folder: Path) -> None:
    """The four files in `folder`."""
    with tempfile.TemporaryDirectory(prefix="llmserve-tokenizer-save-") as saved:
        tokenizer.save_pretrained(saved)
        whole = json.loads(Path(saved, "tokenizer.json").read_text())
        # The server tokenizes each input alone, unpadded and uncut (all-MiniLM-L6-v2's file pads and truncates to
        # 128, which smg applied to every /v1/embeddings input): a gateway must tokenize as the server does.
        whole["padding"] = whole["truncation"] = None
        (folder / "tokenizer.json").write_text(json.dumps(whole, ensure_ascii=False))
        config = json.loads(Path(saved, "tokenizer_config.json").read_text())
    # transformers 5 writes the template to chat_template.jinja; readers of tokenizer_config.json look there.
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name other readers know for a tokenizer.json
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    ids = json.dumps({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": list(eos_token_ids)}, indent=1)
    (folder / "config.json").write_text(ids)
    (folder / "generation_config.json").write_text(ids)


def zip_folder(folder: Path) -> bytes:
    """The files at the zip's root, in a fixed order with fixed times: equal files give equal bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in FILES:
            archive.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), (folder / name).read_bytes())
    return out.getvalue()


def chunks(data: bytes, sha256: str) -> Iterator[tuple[bytes, str]]:
    """(bytes, sha256) per GetTokenizerChunk: the digest on the last chunk only."""
    starts = range(0, len(data), CHUNK_BYTES)
    for i, start in enumerate(starts):
        yield data[start : start + CHUNK_BYTES], sha256 if i == len(starts) - 1 else ""


class TokenizerBundle:
    """The files of one served tokenizer, in a folder of their own (removed by `close`), built on first use."""

    def __init__(self) -> None:
        self._built: asyncio.Task[TokenizerFiles] | None = None
        self._folder: Path | None = None

    async def get(self, tokenizer: Any, eos_token_ids: Sequence[int]) -> TokenizerFiles:
        if self._built is None or (self._built.done() and self._built.exception() is not None):
            self._built = asyncio.ensure_future(asyncio.to_thread(self._build, tokenizer, tuple(eos_token_ids)))
        return await asyncio.shield(self._built)

    def _build(self, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> TokenizerFiles:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="llmserve-tokenizer-"))
        write_files(tokenizer, eos_token_ids, self._folder)
        data = zip_folder(self._folder)
        return TokenizerFiles(self._folder, data, hashlib.sha256(data).hexdigest())

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
