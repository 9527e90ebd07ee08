"""The CPU backend says what serves, and on a CPU without AMX (or without AVX512-BF16) it falls back for real.

A machine without AMX is simulated with LLMSERVE_CPU_ISA, which `configure_process` hands to oneDNN before torch
loads. Each case runs in a process of its own, as a server starts: the backend's description names the kernel
oneDNN ran for the packed linears (its instruction set read from oneDNN's own verbose record), so a fallback that
kept AMX code, or AVX512-BF16 code on a CPU without it, fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmserve import cpu_features
from llmserve.engine.backends.cpu.backend import CpuBackend
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.models.loader import from_config, load_model
from tests.isa import needs_dtype
from tests.testing import tiny_config

START = """
import json, sys
from llmserve.process_settings import configure_process
configure_process()
import torch
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.models.loader import load_model, resolve_dtype
auto = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
for dtype in sys.argv[1:]:
    try:
        loaded = load_model("random:tiny", device="cpu", dtype=dtype)
        backend = EngineCore(loaded, EngineConfig(kv_cache_tokens=256)).backend
    except ValueError as exc:
        print(json.dumps({"auto": auto, "error": str(exc)}))
        continue
    print(json.dumps({"auto": auto, "description": backend.description}))
"""
LEVEL = cpu_features.cpu_level()
# The caps whose outcome differs (cpu_features.DTYPE_NEEDS), each tried where this CPU reaches it.
CAPS = ("none", "avx2", "avx512_core", "avx512_core_vnni")


def start(cap: str | None, *dtypes: str) -> list[dict[str, str]]:
    """A server's start-up as far as its backend, in a process of its own capped at `cap`, once per dtype."""
    env = {k: v for k, v in os.environ.items() if k not in (cpu_features.ENV, cpu_features.ONEDNN_ENV)}
    if cap is not None:
        env[cpu_features.ENV] = cap
    out = subprocess.run(
        [sys.executable, "-c", START, *dtypes], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(dtypes) :]]


@pytest.mark.parametrize("cap", CAPS)
def test_each_dtype_serves_or_is_refused_at_start_naming_the_instruction_set(cap: str) -> None:
    """At each level this CPU reaches (capped): a dtype the level cannot serve is refused before serving, the
    message naming what it needs, the level, and what serves instead; the rest serve through the fused forward
    (no fallback to transformers' layers); `auto` picks one that serves."""
    if not cpu_features.at_least(LEVEL, cap):
        pytest.skip(f"this CPU is below {cap}")
    dtypes = ("float32", "bfloat16", "int8", "float16", "auto")
    for dtype, served in zip(dtypes, start(cap, *dtypes), strict=True):
        refused = cpu_features.refusal(dtype, cap, {cpu_features.ENV: cap})
        if refused is None:
            assert "error" not in served, (dtype, served)
            assert served["description"].startswith("fused Llama-family forward"), (dtype, served)
            assert served["description"].endswith(f"CPU {cap}"), served
            continue
        error = served["error"]
        assert error == refused and f"this CPU's level is {cap}, capped by {cpu_features.ENV}." in error, error
        assert "--dtype float32" in error and "--dtype gguf" in error, error
    assert cpu_features.refusal(served["auto"], cap) is None


@pytest.mark.skipif(not cpu_features.at_least(LEVEL, "avx512_core"), reason="needs AVX-512")
@pytest.mark.parametrize("cap", ["avx512_core_bf16", "avx512_core"])
def test_a_cpu_without_amx_or_bf16_falls_back_for_real(cap: str) -> None:
    """bfloat16 asked for on a CPU capped to `cap`: the kernels oneDNN runs are of that level; `--dtype auto`
    picks what cpu_features.auto_dtype says for it; the description names the capped level; int8 is refused
    below AVX512-VNNI."""
    if not cpu_features.at_least(LEVEL, cap):
        pytest.skip(f"this CPU is below {cap}")
    served, int8 = start(cap, "bfloat16", "int8")
    description = served["description"]
    assert description.endswith(f"CPU {cap}") and "amx" not in description
    assert served["auto"] == cpu_features.auto_dtype(cap)
    kernel = description.split("packed oneDNN linears (")[1].split(")")[0]
    if cap == "avx512_core":  # no AVX512-BF16 instructions either (oneDNN converts through float32: gemm:jit)
        assert "bf16" not in kernel, kernel
        assert "needs AVX512-VNNI or AMX" in int8["error"] and "level is avx512_core," in int8["error"], int8
    else:
        assert kernel.endswith("avx512_core_bf16"), kernel


def test_the_float32_description_names_precision_and_level() -> None:
    f32 = EngineCore(from_config(tiny_config("llama"), dtype=torch.float32), EngineConfig(kv_cache_tokens=256))
    description = f32.backend.description
    assert description.startswith("fused Llama-family forward (float32, float32 residual)"), description
    assert "compiled decode kernel over a float32 KV cache" in description and "for every token" not in description
    assert "packed oneDNN linears" in description and description.endswith(f"CPU {LEVEL}")


def test_a_bfloat16_model_built_in_process_is_refused_where_its_level_cannot_serve_it() -> None:
    """A model built without --dtype (from_config) meets the same refusal as the flag: no quiet fallback to
    transformers' bfloat16 layers, several times slower."""
    loaded = from_config(tiny_config("llama"), dtype=torch.bfloat16)
    refused = cpu_features.refusal("bfloat16", LEVEL)
    if refused is None:
        assert EngineCore(loaded, EngineConfig(kv_cache_tokens=256)).backend.fused is not None
    else:
        with pytest.raises(ValueError, match="needs AVX-512"):
            EngineCore(loaded, EngineConfig(kv_cache_tokens=256))


@needs_dtype("bfloat16")
def test_the_description_names_precision_cache_and_kernel() -> None:
    loaded = from_config(tiny_config("llama"), dtype=torch.bfloat16)
    backend = EngineCore(loaded, EngineConfig(kv_cache_tokens=256)).backend
    assert isinstance(backend, CpuBackend)
    description = backend.description
    assert description.startswith("fused Llama-family forward (bfloat16, float32 residual)")
    assert "compiled decode kernel over a bfloat16 KV cache for every token" in description
    assert "9 packed oneDNN linears (brg_matmul:" in description and description.endswith(f"CPU {LEVEL}")
    if cpu_features.at_least(LEVEL, "avx512_core_bf16") and cpu_features.ENV not in os.environ:
        # Uncapped, oneDNN uses what the CPU has: AMX tiles, else AVX512-BF16 dot products.
        assert ("amx" if LEVEL == "avx512_core_amx" else "avx512_core_bf16") in description, description


def test_a_classifier_gets_no_lm_head(tmp_path: Path) -> None:
    """A sequence classifier never samples: its fused forward packs no copy of the vocabulary-sized LM head (a
    Qwen2-1.5B reward model's would be ~0.9 GB of float32), while a generating model keeps its head."""
    from tests.classifier_models import save_llama_classifier

    loaded = load_model(str(save_llama_classifier(tmp_path / "classifier")), device="cpu", dtype="float32")
    backend = EngineCore(loaded, EngineConfig(kv_cache_tokens=256)).backend
    assert isinstance(backend, CpuBackend) and backend.fused is not None
    assert backend.fused.lm_head is None and len(backend.fused.linears()) == 4 * 2
    generating = EngineCore(from_config(tiny_config("llama"), dtype=torch.float32), EngineConfig(kv_cache_tokens=256))
    assert isinstance(generating.backend, CpuBackend) and generating.backend.fused is not None
    assert generating.backend.fused.lm_head is not None
