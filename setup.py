"""Builds the CPU backend's C kernels at install time (`pip install .`, `pip install -e .`, `make kernels`).

The kernels are plain C libraries loaded with ctypes (no Python API), so they are built with our own compiler
line rather than as Python extension modules; setuptools only decides when and where (next to the package's
modules, also for editable installs). Both are optional: without a C compiler the install still succeeds and
the server runs the slower torch paths, or refuses to start with `--cpu-kernels require`.

- `_paged_decode`: decode attention, once per common (head dim, query heads per kv head) pair;
- `_fused_ops`: the fused elementwise parts of a Llama-family layer (float32/float64, and the bfloat16/int8 rows of
  mixed_ops.c), and forward.c's whole step over a GGUF's blocks in one call.
- `_quant_ops`: linears over llama.cpp's block-quantized weights (quant*.c). On x86-64 it is built for the baseline
  (`-march=x86-64`) whatever LLMSERVE_KERNEL_MARCH says: its AVX2 and AVX-512 kernels carry their own target
  pragmas and the library picks among them at run time by what the CPU reports, so one build serves every level.
- `_amx_ops`: float32 linears as three bfloat16 products on AMX tiles (amx_ops.c, split_linear.py); built for the
  baseline like `_quant_ops` (its target pragma asks for AMX), run only where the CPU has it.

On x86-64 the two libraries whose C the compiler vectorizes for its target (`_paged_decode`, `_fused_ops`) are built
once per instruction-set level the server runs them at (native.py picks by cpu_features' level, as capped): the
plain name for AVX2 and up (`-march=x86-64-v3`: AVX2, FMA, F16C), `<name>_portable` for the x86-64 baseline (SSE2).
So one build serves every x86 CPU, and a server capped with LLMSERVE_CPU_ISA runs the very code a CPU of that level
runs (CI's capped legs, tests/engine/backends/cpu/test_kernel_isa.py). LLMSERVE_KERNEL_MARCH overrides the AVX2
build's target (another machine's `-march=native`, say); elsewhere than x86-64 it defaults to `native`.
"""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

CSRC = Path("server/llmserve/engine/backends/cpu/csrc")
PACKAGE = "llmserve.engine.backends.cpu"
# SmolLM2 (64, 3), Llama 3.2 1B (64, 4), Qwen3-0.6B (128, 2), Qwen2.5-0.5B (64, 7), Llama/Mistral 7-8B (128, 4),
# the tests' tiny models (16, 2)... Other shapes decode through the torch path.
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
GROUPS = tuple(range(1, 9))
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")
# Tried in order: with glibc's vector exp (x86-64 glibc >= 2.22), then without.
VARIANTS = (("-DVECTOR_EXP", "-lmvec"), ())
X86 = platform.machine().lower() in ("x86_64", "amd64")
PORTABLE = "_portable"  # the suffix of the x86-64 baseline builds (native.py's library names)


def paged_decode_source(folder: Path, name: str) -> Path:
    """A translation unit that includes paged_decode.c once per (head dim, group) pair, named after the library
    `name` (the levels' builds run side by side)."""
    lines = []
    for head_dim, group in itertools.product(HEAD_DIMS, GROUPS):
        lines += [
            f"#define HEAD_DIM {head_dim}",
            f"#define GROUP {group}",
            f"#define VARIANT _d{head_dim}_g{group}",
            '#include "paged_decode.c"',
            "#undef HEAD_DIM",
            "#undef GROUP",
            "#undef VARIANT",
        ]
    path = folder / f"{name}_variants.c"
    path.write_text("\n".join(lines) + "\n")
    return path


class BuildKernels(build_ext):
    def finalize_options(self) -> None:
        super().finalize_options()
        # The libraries compile side by side (pip passes no -j): _paged_decode's one translation unit of 56
        # variants takes longest (18.7 s on the 2-core machine), _quant_ops (8.1 s) and _fused_ops (0.5 s) fit
        # beside it.
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(self.build_temp)
        temp.mkdir(parents=True, exist_ok=True)
        paged = ext.name.endswith(("_paged_decode", f"_paged_decode{PORTABLE}"))
        sources = [paged_decode_source(temp, ext.name.split(".")[-1])] if paged else [Path(s) for s in ext.sources]
        compiler = os.environ.get("CC", "cc")
        march = os.environ.get("LLMSERVE_KERNEL_MARCH", "x86-64-v3" if X86 else "native")
        if ext.name.endswith(("_quant_ops", "_amx_ops", PORTABLE)) and X86:
            march = "x86-64"
        exact = ("_fused_ops", "_quant_ops", f"_fused_ops{PORTABLE}")  # no fused multiply-adds the C did not ask for
        extra = ["-ffp-contract=off"] if ext.name.endswith(exact) else []
        detail = ""
        for variant in VARIANTS:
            defines, libraries = variant[:1], variant[1:]
            command = [compiler, *FLAGS, f"-march={march}", *extra, *defines, f"-I{CSRC.resolve()}"]
            command += ["-o", str(target), *map(str, sources), *libraries, "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                return
            detail = result.stderr[-2000:]
        raise CompileError(f"building {ext.name} failed: {detail}")


# The compiler-vectorized libraries, once per level on x86-64 (see the module docstring).
LEVEL_SUFFIXES = ("", PORTABLE) if X86 else ("",)
VECTORIZED = {"_paged_decode": ["paged_decode.c"], "_fused_ops": ["fused_ops.c", "mixed_ops.c", "forward.c"]}

setup(
    ext_modules=[
        *(
            Extension(f"{PACKAGE}.{name}{suffix}", [str(CSRC / f) for f in files], optional=True)
            for name, files in VECTORIZED.items()
            for suffix in LEVEL_SUFFIXES
        ),
        Extension(
            f"{PACKAGE}._quant_ops",
            [str(CSRC / name) for name in ("quant_ops.c", "quant_avx2.c", "quant_avx512.c")],
            optional=True,
        ),
        Extension(f"{PACKAGE}._amx_ops", [str(CSRC / "amx_ops.c")], optional=True),
    ],
    cmdclass={"build_ext": BuildKernels},
)
