"""What the CPU can do for the kernels, read once without torch: its instruction-set level, the cap that hides part
of it, and the dtype `--dtype auto` picks from it.

Levels, in order (oneDNN's names, which `ONEDNN_MAX_CPU_ISA` takes):
- `avx2`: AVX2 and FMA;
- `avx512_core`: AVX-512 F/BW/VL/DQ;
- `avx512_core_vnni`: with AVX512-VNNI (int8 dot products that do not saturate);
- `avx512_core_bf16`: with AVX512-BF16 (bf16 dot products into float32);
- `avx512_core_amx`: with AMX tiles for bf16 and int8.

`LLMSERVE_CPU_ISA=<level>` caps the level, as on a CPU without the rest: `configure_process` (before torch loads)
also caps oneDNN's kernels there through `ONEDNN_MAX_CPU_ISA`, and `--dtype auto` and `--dtype int8` decide by
the capped level. So a machine with AMX can run, and test, the path of a machine without it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

ENV = "LLMSERVE_CPU_ISA"
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
LEVELS = ("none", "avx2", "avx512_core", "avx512_core_vnni", "avx512_core_bf16", "avx512_core_amx")
# The /proc/cpuinfo flags each level needs beyond the one below it.
_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512_core": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_core_vnni": ("avx512_vnni",),
    "avx512_core_bf16": ("avx512_bf16",),
    "avx512_core_amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
# Where --dtype auto picks bfloat16: with AMX-BF16 (the issue's measurement: a bf16 linear of SmolLM2's MLP shape
# ~3x float32 there). Below it, float32: the exact path, and what the server and its tests run by default on an
# AVX512-BF16 machine; `--dtype bfloat16` still runs the fused bf16 forward there (benchmarks/README.md,
# "bfloat16 and int8 on the CPU", says what it gives).
BF16_FROM = "avx512_core_amx"
# --dtype int8 multiplies u8 x s8 on oneDNN's kernels; below VNNI those add pairs of products into int16 with
# saturation, which int8 activations of full range overflow.
INT8_FROM = "avx512_core_vnni"
# --dtype bfloat16's packed linears: oneDNN refuses bfloat16 weights without AVX-512 BW/VL/DQ (or AVX-NE-CONVERT,
# which no level here names), and transformers' bfloat16 layers on such a CPU are several times slower than float32.
BF16_MIN = "avx512_core"
# The lowest level each --dtype serves from on the CPU, with what it needs there and why. A dtype not named serves at
# every level (float32, float64, gguf: our own kernels and oneDNN's float32 ones at whatever level the CPU has).
# float16 has no fused forward and no packed kernel on any CPU level (transformers' layers, converting every
# operation): it is refused on the CPU at every level.
DTYPE_NEEDS = {
    "bfloat16": (BF16_MIN, "AVX-512 (F, BW, VL, DQ) for oneDNN's bfloat16 linears"),
    "int8": (INT8_FROM, "AVX512-VNNI or AMX for oneDNN's int8 linears (below VNNI they saturate int16 sums)"),
    "float16": (None, "a float16 path, which no CPU level has here (transformers' layers, several times slower)"),
}
# What serves instead, by whether the model is a GGUF file (its blocks run at every level through our kernels).
INSTEAD = (
    "--dtype float32 (exact: packed oneDNN linears at every level), or a GGUF file with --dtype gguf (its blocks "
    "through llmserve's kernels at every level; a Q8_0 file is the int8 weights' counterpart)"
)


class IsaError(ValueError):
    """LLMSERVE_CPU_ISA names no level."""


def _first(cpuinfo: Path, key: str) -> str | None:
    """The first processor's `key` line's value in /proc/cpuinfo; None where the file cannot be read or has none."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() == key:
            return value.strip()
    return None


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags; empty where /proc/cpuinfo cannot be read (not Linux). Read once per file: the
    fused forward asks the level for each of its linears, and the file lists every processor."""
    return frozenset((_first(cpuinfo, "flags") or "").split())


@functools.cache
def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's model name ("unknown" where /proc/cpuinfo cannot be read or has none)."""
    return _first(cpuinfo, "model name") or "unknown"


def detected_level(flags: frozenset[str]) -> str:
    """The highest level whose flags (and every lower level's) the CPU has."""
    level = "none"
    for name in LEVELS[1:]:
        if not all(flag in flags for flag in _NEEDS[name]):
            break
        level = name
    return level


def capped(level: str, environ: Mapping[str, str] = os.environ) -> str:
    """`level` lowered to LLMSERVE_CPU_ISA where that is set and lower. Raises IsaError for an unknown name."""
    cap = environ.get(ENV, "").strip().lower()
    if not cap:
        return level
    if cap not in LEVELS:
        raise IsaError(f"{ENV}={cap!r} is not one of {', '.join(LEVELS)}")
    return LEVELS[min(LEVELS.index(level), LEVELS.index(cap))]


def cpu_level(environ: Mapping[str, str] = os.environ) -> str:
    """This CPU's level as the kernels may use it: detected, then capped by LLMSERVE_CPU_ISA."""
    return capped(detected_level(cpu_flags()), environ)


def at_least(level: str, floor: str) -> bool:
    return LEVELS.index(level) >= LEVELS.index(floor)


def auto_dtype(level: str) -> str:
    """`--dtype auto` on a CPU of this level: bfloat16 from BF16_FROM up, float32 below."""
    return "bfloat16" if at_least(level, BF16_FROM) else "float32"


def refusal(dtype: str, level: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why `--dtype dtype` cannot serve on a CPU of `level` (as capped), naming the instruction set it misses and
    what serves instead; None where it serves. `environ` says whether LLMSERVE_CPU_ISA capped the level."""
    if dtype not in DTYPE_NEEDS:
        return None
    floor, needs = DTYPE_NEEDS[dtype]
    if floor is not None and at_least(level, floor):
        return None
    shown = f"{level}, capped by {ENV}" if environ.get(ENV, "").strip() else level
    return f"--dtype {dtype} on the CPU needs {needs}; this CPU's level is {shown}. Serve {INSTEAD}"


def cap_onednn(environ: MutableMapping[str, str] = os.environ) -> None:
    """Hand a LLMSERVE_CPU_ISA cap to oneDNN (ONEDNN_MAX_CPU_ISA), which reads it once, when torch first uses it:
    call before torch is imported. A cap of `none` leaves oneDNN at its lowest vector level it knows (SSE4.1)."""
    cap = environ.get(ENV, "").strip().lower()
    if not cap:
        return
    if cap not in LEVELS:
        raise IsaError(f"{ENV}={cap!r} is not one of {', '.join(LEVELS)}")
    environ[ONEDNN_ENV] = "SSE41" if cap == "none" else cap.upper()


if __name__ == "__main__":  # `python -m llmserve.cpu_features`: the level detected, uncapped (make pytest-isa)
    print(detected_level(cpu_flags()))
