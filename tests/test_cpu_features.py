"""The CPU's instruction-set level, its cap (LLMSERVE_CPU_ISA) and what `--dtype auto` makes of it, without torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve import cpu_features
from llmserve.cpu_features import IsaError, at_least, auto_dtype, cap_onednn, capped, detected_level, refusal

AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
# This session's machine and an AMX one, by their /proc/cpuinfo flags.
NO_AMX = frozenset(AVX512 | {"avx512_vnni", "avx512_bf16"})
AMX = frozenset(NO_AMX | {"amx_tile", "amx_bf16", "amx_int8"})


def test_levels_follow_the_flags() -> None:
    assert detected_level(frozenset()) == "none"
    assert detected_level(frozenset({"avx2", "fma"})) == "avx2"
    assert detected_level(frozenset(AVX512)) == "avx512_core"
    assert detected_level(NO_AMX) == "avx512_core_bf16"
    assert detected_level(AMX) == "avx512_core_amx"
    # A level needs every level below it: AMX flags without AVX512-BF16 stop at VNNI.
    assert detected_level(AMX - {"avx512_bf16"}) == "avx512_core_vnni"


def test_the_cap_lowers_never_raises() -> None:
    assert capped("avx512_core_amx", {"LLMSERVE_CPU_ISA": "avx512_core_bf16"}) == "avx512_core_bf16"
    assert capped("avx512_core_bf16", {"LLMSERVE_CPU_ISA": "AVX512_CORE_AMX"}) == "avx512_core_bf16"
    assert capped("avx512_core_bf16", {}) == "avx512_core_bf16"
    with pytest.raises(IsaError, match="LLMSERVE_CPU_ISA='amx2'"):
        capped("avx512_core_amx", {"LLMSERVE_CPU_ISA": "amx2"})


def test_auto_picks_bfloat16_with_amx_only() -> None:
    assert [auto_dtype(level) for level in cpu_features.LEVELS] == ["float32"] * 5 + ["bfloat16"]
    assert at_least("avx512_core_amx", cpu_features.INT8_FROM) and not at_least("avx512_core", cpu_features.INT8_FROM)


def test_the_cap_reaches_onednn_before_torch_loads() -> None:
    env = {"LLMSERVE_CPU_ISA": "avx512_core_bf16"}
    cap_onednn(env)
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    env = {"LLMSERVE_CPU_ISA": "none"}
    cap_onednn(env)
    assert env["ONEDNN_MAX_CPU_ISA"] == "SSE41"
    untouched: dict[str, str] = {}
    cap_onednn(untouched)
    assert untouched == {}
    with pytest.raises(IsaError):
        cap_onednn({"LLMSERVE_CPU_ISA": "sse9"})


def test_flags_come_from_proc_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\nbugs\t\t: none\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_features.cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_features.cpu_flags(tmp_path / "missing") == frozenset()


def test_name_comes_from_proc_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R45\nflags\t: fpu\nprocessor\t: 1\nmodel name\t: other\n")
    assert cpu_features.cpu_name(info) == "AMD EPYC 9R45"
    (tmp_path / "bare").write_text("processor\t: 0\nflags\t\t: fpu\n")
    assert cpu_features.cpu_name(tmp_path / "bare") == "unknown"
    assert cpu_features.cpu_name(tmp_path / "missing") == "unknown"


def test_each_dtype_is_refused_exactly_below_its_level_and_auto_never_picks_a_refused_one() -> None:
    served = {level: [d for d in ("float32", "bfloat16", "int8", "float16") if refusal(d, level, {}) is None]
              for level in cpu_features.LEVELS}  # fmt: skip
    assert served == {
        "none": ["float32"],
        "avx2": ["float32"],
        "avx512_core": ["float32", "bfloat16"],
        "avx512_core_vnni": ["float32", "bfloat16", "int8"],
        "avx512_core_bf16": ["float32", "bfloat16", "int8"],
        "avx512_core_amx": ["float32", "bfloat16", "int8"],
    }
    assert all(refusal(auto_dtype(level), level, {}) is None for level in cpu_features.LEVELS)
    assert refusal("gguf", "none", {}) is None and refusal("float64", "none", {}) is None
    message = refusal("bfloat16", "avx2", {"LLMSERVE_CPU_ISA": "avx2"})
    assert message is not None and message.startswith("--dtype bfloat16 on the CPU needs AVX-512 (F, BW, VL, DQ)")
    assert "level is avx2, capped by LLMSERVE_CPU_ISA." in message and "--dtype gguf" in message
    assert "level is avx2." in (refusal("int8", "avx2", {}) or "")
