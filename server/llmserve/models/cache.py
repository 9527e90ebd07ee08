"""Folders made once under the cache root (`$LLMSERVE_CACHE_DIR`, else `~/.cache/llmserve`): a GGUF's converted
copy or its tokenizer and config (gguf.py), a packaged model's extracted archive (packaged.py).

Each folder appears in one atomic rename of a finished temporary folder beside it, with a marker file naming its
source and the source's size: a run killed halfway leaves no half-written folder (its partial folder is removed by a
later run once stale), two processes filling it at once both end with the same folder (the loser discards its
copy), and a folder made from a source of another size is made again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "LLMSERVE_CACHE_DIR"
MARKER = "llmserve.json"
# A fill takes at most about a minute; a partial folder older than this belongs to a killed one.
STALE_PARTIAL_S = 3600.0


def default_cache_root() -> Path:
    """`$LLMSERVE_CACHE_DIR` when set, else `~/.cache/llmserve`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmserve"


def cached_folder(
    source: Path,
    target: Path,
    name: str,
    fill: Callable[[Path], None],
    verb: str,
) -> Path:
    """`target`, filled by `fill(folder)` unless it already holds a finished fill from a `source` of the same size;
    `name` goes into the marker (the model's display name), `verb` into the log line ("extracted", "converted")."""
    source_bytes = source.stat().st_size
    if is_finished(target, source_bytes):
        return target
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root, target.name)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=root))
    try:
        started = time.monotonic()
        fill(partial)
        marker = {"name": name, "source": str(source), "source_bytes": source_bytes}
        (partial / MARKER).write_text(json.dumps(marker, indent=2))
        partial.chmod(0o755)  # mkdtemp makes it private; a model cache is ordinary readable data
        _publish(partial, target, source_bytes)
        log.info("%s %s into %s in %.1f s", verb, source.name, target, time.monotonic() - started)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def is_finished(folder: Path, source_bytes: int) -> bool:
    """Whether `folder` holds a finished fill from a source of `source_bytes` bytes."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_bytes") == source_bytes and (folder / "config.json").is_file()


def _remove_stale_partials(root: Path, stem: str) -> None:
    now = time.time()
    for leftover in root.glob(f".{stem}.*.partial"):
        try:
            if now - leftover.stat().st_mtime > STALE_PARTIAL_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


def _publish(partial: Path, target: Path, source_bytes: int) -> None:
    """Move a finished fill into place; an outdated one there is replaced."""
    if target.exists() and not is_finished(target, source_bytes):
        outdated = target.with_name(f".{target.name}.{os.getpid()}.old.partial")
        target.rename(outdated)
        shutil.rmtree(outdated, ignore_errors=True)
    try:
        partial.rename(target)
    except OSError:
        # Renaming onto a non-empty folder fails: another process finished first, and its copy is as good.
        if not is_finished(target, source_bytes):
            raise
