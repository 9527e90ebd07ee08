"""Each compiled level holds only its level's instructions, read from the machine code itself (objdump).

A capped run (LLMSERVE_CPU_ISA=avx2 on an AVX-512 machine) executes the avx2 level, but an AVX-512 instruction
planted there would still run on that machine and pass every test: only an AVX2 CPU would fault on it. So the
libraries are disassembled and each function is held to its level (setup.py, quant.h):
- `_quant_ops`: `*_avx512_vnni` functions anything; `*_avx2_vnni` AVX2 with AVX-VNNI, no AVX-512 (no zmm, no mask
  registers, no EVEX-only forms); `*_avx2` the same without VNNI dot products; every other function the x86-64
  baseline (SSE2: no VEX-encoded instructions at all), since it runs at the portable level too;
- `_paged_decode`, `_fused_ops`: their AVX2 build (x86-64-v3) no AVX-512, their `_portable` build the baseline.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from llmserve.engine.backends.cpu import native, quant

pytestmark = [
    pytest.mark.skipif(not native.X86, reason="the levels are x86-64's"),
    pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils) to read the machine code"),
]

FUNCTION = re.compile(r"^[0-9a-f]+ <(?P<name>[^>]+)>:$")
# What betrays AVX-512 in AT&T syntax: its 512-bit and mask registers, EVEX's embedded broadcast/rounding, or the
# registers 16-31 only EVEX encodes.
AVX512 = re.compile(r"%zmm|%k[0-7]\b|\{1to\d+\}|\{[rs][nudz]-sae\}|%[xy]mm(1[6-9]|2\d|3[01])\b")
VNNI = re.compile(r"\bvpdp(bu|ws)sds?\b")
VEX = re.compile(r"^\s*[0-9a-f]+:\s+(\{vex\}\s+)?v[a-z]|%ymm")


def functions(path: Path) -> dict[str, list[str]]:
    """The disassembly of each function of the library at `path`, by symbol name."""
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True, check=True
    ).stdout
    out: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in text.splitlines():
        if match := FUNCTION.match(line):
            lines = out.setdefault(match["name"], [])
        elif line.strip():
            lines.append(line)
    return out


def offences(code: list[str], forbidden: re.Pattern[str]) -> list[str]:
    return [line.strip() for line in code if forbidden.search(line)]


def installed(name: str, level: str) -> Path:
    path = native.library_file(name, level)
    if not path.exists():
        pytest.skip(f"{path.name} is not built (make kernels)")
    return path


def level_of(function: str) -> str:
    """The quant level a `_quant_ops` function belongs to, by its name's suffix (quant_avx2.c's NAME)."""
    for level in ("avx512_vnni", "avx2_vnni", "avx2"):
        if f"_{level}" in function:
            return level
    return "baseline"


def test_each_quant_function_holds_only_its_levels_instructions() -> None:
    code = functions(installed(quant.LIBRARY, "avx2"))
    by_level: dict[str, list[str]] = {}
    for name in code:
        by_level.setdefault(level_of(name), []).append(name)
    # The kernels of each level are there to check (a renamed level would check nothing).
    assert {"q_kernel_avx2", "q_kernel_avx2_vnni", "q_kernel_avx512_vnni", "q_kernel_portable"} <= set(code)
    bad = {}
    for name, lines in code.items():
        level = level_of(name)
        rules = {"avx2": [AVX512, VNNI], "avx2_vnni": [AVX512], "baseline": [VEX]}.get(level, [])
        found = [line for rule in rules for line in offences(lines, rule)]
        if found:
            bad[name] = found[:3]
    assert not bad, bad
    # The dispatcher's own code is baseline: the AVX2 levels' bodies really are AVX2 (else the rules check nothing).
    assert any(offences(code["q_kernel_avx2"], VEX)) and not offences(code["q_kernel_avx2"], VNNI)
    assert any(offences(code["q_kernel_avx2_vnni"], VNNI))


@pytest.mark.parametrize("name", native.LIBRARIES)
def test_the_vectorized_libraries_hold_their_levels_instructions(name: str) -> None:
    for level, forbidden in (("avx2", AVX512), ("none", VEX)):
        code = functions(installed(name, level))
        bad = {f: offences(lines, forbidden)[:3] for f, lines in code.items() if offences(lines, forbidden)}
        assert not bad, (level, bad)
    avx2 = functions(installed(name, "avx2"))
    assert any(offences(lines, VEX) for lines in avx2.values())  # the AVX2 build is one
