"""Builds the CPU backend's C kernels at install time (`pip install .`, `pip install -e .`, `make kernels`).

The kernels are plain C libraries loaded with ctypes (no Python API), so they are built with our own compiler
line rather than as Python extension modules; setuptools only decides when and where (next to the package's
modules, also for editable installs). Both are optional: without a C compiler the install still succeeds and
the server runs the slower torch paths, or refuses to start with `--cpu-kernels require`.

- `_paged_decode`: decode attention, once per common (head dim, query heads per kv head) pair;
- `_fused_ops`: the fused elementwise parts of a Llama-family layer (float32/float64, and the bfloat16/int8 rows of
  mixed_ops.c).
- `_quant_ops`: linears over llama.cpp's block-quantized weights (quant*.c). On x86-64 it is built for the baseline
  (`-march=x86-64`) whatever LLMSERVE_KERNEL_MARCH says: its AVX2 and AVX-512 kernels carry their own target
  pragmas and the library picks among them at run time by what the CPU reports, so one build serves every level.
- `_amx_ops`: float32 linears as three bfloat16 products on AMX tiles (amx_ops.c, split_linear.py); built for the
  baseline like `_quant_ops` (its target pragma asks for AMX), run only where the CPU has it.

LLMSERVE_KERNEL_MARCH picks the target CPU (default `native`, the machine that installs; an image built on one
machine and run on others wants a portable level such as `x86-64-v3`).
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


def paged_decode_source(folder: Path) -> Path:
    """A translation unit that includes paged_decode.c once per (head dim, group) pair."""
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
    path = folder / "paged_decode_variants.c"
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
        sources = [paged_decode_source(temp)] if ext.name.endswith("_paged_decode") else [Path(s) for s in ext.sources]
        compiler = os.environ.get("CC", "cc")
        march = os.environ.get("LLMSERVE_KERNEL_MARCH", "native")
        if ext.name.endswith(("_quant_ops", "_amx_ops")) and platform.machine().lower() in ("x86_64", "amd64"):
            march = "x86-64"
        extra = ["-ffp-contract=off"] if ext.name.endswith(("_fused_ops", "_quant_ops")) else []
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


setup(
    ext_modules=[
        Extension(f"{PACKAGE}._paged_decode", [str(CSRC / "paged_decode.c")], optional=True),
        Extension(f"{PACKAGE}._fused_ops", [str(CSRC / "fused_ops.c"), str(CSRC / "mixed_ops.c")], optional=True),
        Extension(
            f"{PACKAGE}._quant_ops",
            [str(CSRC / name) for name in ("quant_ops.c", "quant_avx2.c", "quant_avx512.c")],
            optional=True,
        ),
        Extension(f"{PACKAGE}._amx_ops", [str(CSRC / "amx_ops.c")], optional=True),
    ],
    cmdclass={"build_ext": BuildKernels},
)
