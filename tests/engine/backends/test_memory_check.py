"""Tests for backends/memory_check.py: a model whose mapped weights and KV pool cannot fit is refused at start with
the numbers, before anything is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.memory_check import GIB, InsufficientMemory, available_bytes, check_fits
from llmserve.engine.config import EngineConfig
from llmserve.models.loader import load_model


def test_the_message_has_the_numbers_and_the_way_out() -> None:
    with pytest.raises(InsufficientMemory) as raised:
        check_fits("model-x", 5 * GIB, 3 * GIB, available=6 * GIB)
    text = str(raised.value)
    for part in ("model-x", "5.00 GiB", "3.00 GiB", "1.00 GiB", "9.00 GiB", "6.00 GiB", "--kv-cache-tokens"):
        assert part in text
    check_fits("model-x", 5 * GIB, 3 * GIB, available=9 * GIB)  # fits exactly
    check_fits("model-x", 5 * GIB, 3 * GIB, available=None)  # unknown: not checked


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683400 kB\nMemFree:         1000 kB\nMemAvailable:   2048 kB\n")
    assert available_bytes(meminfo) == 2048 * 1024
    assert available_bytes(tmp_path / "absent") is None
    here = available_bytes()
    assert here is None or here > 0


@pytest.mark.real_model
def test_a_gguf_whose_kv_pool_cannot_fit_is_refused_before_its_blocks_are_read() -> None:
    # The file's tokenizer and config from the default cache, as `make model` left them (the `real_model` fixture's
    # too): a cache of its own made them again, 10 CPU-s (tests/test_gguf_model.py tests that extraction).
    loaded = load_model(None, device="cpu", dtype="gguf")
    available = available_bytes()
    assert available is not None
    # SmolLM2's float32 KV: 180 KiB a token; a pool of 2**24 tokens is 2.8 TiB.
    with pytest.raises(InsufficientMemory, match="SmolLM2-135M-Instruct does not fit"):
        create_backend(loaded, EngineConfig(kv_cache_tokens=1 << 24))
