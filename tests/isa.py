"""What a test needs of the CPU, decided by the detection the product uses: cpu_features' level, as LLMSERVE_CPU_ISA
caps it (CI's capped legs run the CPU-path tests at `avx2` and `none` on any machine above, `make pytest-isa`). A
test that needs an instruction set says so with one of these marks and skips with the reason where it is missing;
a test of a refusal runs where the refusal happens (capped, if need be: tests/engine/backends/cpu/test_backend.py).
"""

from __future__ import annotations

import pytest

from llmserve import cpu_features

LEVEL = cpu_features.cpu_level()


def needs_level(level: str) -> pytest.MarkDecorator:
    """Skip unless this CPU, as capped, is at `level` (one of cpu_features.LEVELS) or above."""
    return pytest.mark.skipif(
        not cpu_features.at_least(LEVEL, level), reason=f"needs the {level} level; this CPU's is {LEVEL}"
    )


def needs_dtype(dtype: str) -> pytest.MarkDecorator:
    """Skip where the CPU backend refuses `--dtype dtype` at this level (cpu_features.refusal), with its reason."""
    refused = cpu_features.refusal(dtype, LEVEL)
    return pytest.mark.skipif(refused is not None, reason=refused or "")


def dtype_param(dtype: str) -> object:
    """`dtype` as a pytest.param that skips where this CPU's level cannot serve it (needs_dtype)."""
    return pytest.param(dtype, marks=needs_dtype(dtype))
