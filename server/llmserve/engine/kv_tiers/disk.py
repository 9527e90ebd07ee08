"""The disk tier: one file per block under `<dir>/<model fingerprint>/`, each checked whole when read.

A file is `HEADER` (magic, fingerprint, digest, parent digest, token count, payload size, payload checksum),
the block's tokens (int64), then the payload (K and V of every layer, the cache's dtype and block layout). It
is written to a temporary name and renamed, so a crash never leaves half a file under a real name. A read
checks every field against what the index expects and the BLAKE2b checksum of the payload: a missing,
truncated, corrupt or foreign file is a failed load (recomputed), never wrong KV. The folder per fingerprint
keeps models apart, and the fingerprint in each file guards against a file copied between folders; since
the digests are stable across processes, a restarted server finds its blocks again (`open` indexes them,
least recently written first).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
from pathlib import Path
from typing import BinaryIO

from llmserve.engine.kv_tiers.index import TierIndex
from llmserve.engine.sched.block_pool import BlockContent, BlockHash

log = logging.getLogger(__name__)

MAGIC = b"LLMSKV01"
HEADER = struct.Struct("<8s16s16s16sIQ16s")  # magic, fingerprint, digest, parent, num tokens, payload, checksum
SUFFIX = ".kv"


class DiskTierError(ValueError):
    """The KV tiers cannot start as configured (folder not writable, a bound below one block, no prefix
    caching): a start-up error that names the flag; `python -m llmserve` exits 2 with it."""


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def check_folder(root: Path, folder: Path | None = None) -> None:
    """Create `folder` (default `root`) and write a file in it, or raise DiskTierError naming --kv-offload-dir
    `root`. The server checks `root` before its engine process loads the model, the tier its own folder."""
    folder = root if folder is None else folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise DiskTierError(f"--kv-offload-dir {str(root)!r} is not a writable folder: {exc}") from exc


class DiskTier:
    """Block files in one folder, at most `capacity_bytes` of payload, least recently used deleted first.

    `put` and `get` do file I/O: the tier worker calls them, never the step thread."""

    name = "disk"

    def __init__(self, root: Path, fingerprint: bytes, capacity_bytes: int, block_bytes: int) -> None:
        if capacity_bytes < block_bytes:
            raise DiskTierError(
                f"--kv-offload-disk-gib: {capacity_bytes} bytes hold no KV block ({block_bytes} bytes each)"
            )
        self.fingerprint = fingerprint
        self.folder = Path(root) / fingerprint.hex()
        check_folder(Path(root), self.folder)
        self.index = TierIndex(capacity_bytes, block_bytes)
        self.block_bytes = block_bytes

    def path(self, block_hash: BlockHash) -> Path:
        return self.folder / (block_hash.hex() + SUFFIX)

    def open(self) -> int:
        """Index the block files already there (a restart); returns how many. Unreadable ones are deleted."""
        found: list[tuple[float, BlockContent]] = []
        for path in self.folder.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write that a crash cut short
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                with path.open("rb") as f:
                    content, _ = self._read_header(f, path.stat().st_size)
                found.append((path.stat().st_mtime, content))
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
        found.sort(key=lambda item: item[0])
        for _, content in found:
            for gone in self.index.add(content):
                self.path(gone).unlink(missing_ok=True)
        return len(self.index)

    def put(self, content: BlockContent, payload: bytes | memoryview) -> bool:
        """Write one block; False if it could not be (full disk, I/O error): then it is simply not in the tier."""
        counters = self.index.counters
        if len(payload) != self.block_bytes:
            counters.failed_stores += 1
            return False
        tokens = struct.pack(f"<{len(content.tokens)}q", *content.tokens)
        header = HEADER.pack(
            MAGIC,
            self.fingerprint,
            content.block_hash,
            content.parent,
            len(content.tokens),
            len(payload),
            checksum(payload),
        )
        path = self.path(content.block_hash)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with tmp.open("wb") as f:
                f.write(header)
                f.write(tokens)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            counters.failed_stores += 1
            if exc.errno != errno.ENOSPC:
                log.warning("KV disk tier: writing %s failed: %s", path.name, exc)
            return False
        for gone in self.index.add(content):
            self.path(gone).unlink(missing_ok=True)
        counters.stored_blocks += 1
        counters.stored_bytes += len(payload)
        return True

    def get(self, content: BlockContent) -> bytes | None:
        """The block's payload if its file holds exactly `content` for this model and passes its checksum;
        None otherwise (the file is dropped and the failure counted)."""
        path = self.path(content.block_hash)
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                found, want = self._read_header(f, size)
                if found != content:
                    raise ValueError("another block's content")
                payload = f.read(self.block_bytes)
                if len(payload) != self.block_bytes or checksum(payload) != want:
                    raise ValueError("checksum mismatch")
        except (OSError, ValueError) as exc:
            log.info("KV disk tier: %s unusable (%s): recomputed", path.name, exc)
            self.index.counters.failed_loads += 1
            self.index.remove(content.block_hash)
            path.unlink(missing_ok=True)
            return None
        self.index.counters.loaded_blocks += 1
        self.index.counters.loaded_bytes += len(payload)
        return payload

    def _read_header(self, f: BinaryIO, size: int) -> tuple[BlockContent, bytes]:
        """The content a block file says it holds, and its payload checksum; ValueError if it is not one of ours
        or its size is not what the header says."""
        raw = f.read(HEADER.size)
        if len(raw) != HEADER.size:
            raise ValueError("truncated header")
        magic, fingerprint, block_hash, parent, num_tokens, payload_len, digest = HEADER.unpack(raw)
        if magic != MAGIC or fingerprint != self.fingerprint:
            raise ValueError("not a block file of this model")
        if payload_len != self.block_bytes or size != HEADER.size + 8 * num_tokens + payload_len:
            raise ValueError("truncated or of another block layout")
        tokens = f.read(8 * num_tokens)
        return BlockContent(block_hash, parent, struct.unpack(f"<{num_tokens}q", tokens)), digest
