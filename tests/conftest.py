"""Shared fixtures: tiny random-weight models built from a config, and the default real model."""

from __future__ import annotations

import os

from llmserve.process_settings import configure_process

configure_process(
    shared_cores=True
)  # as `python -m llmserve` does, before torch is imported; two workers share the cores
# Triton kernels run through Triton's interpreter on the CPU (tests/engine/backends/test_triton_attention.py). Triton
# decides per kernel, and for its own library once, when it is first imported, which torch may do early.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Servers the tests start as subprocesses keep their session histories in memory unless a test names a store:
# the default (a SQLite file in the user's cache directory) would carry sessions from one test, or one run, into
# the next.
os.environ.setdefault("LLMSERVE_HISTORY_STORE", "memory")

import gc  # noqa: E402

import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

# The files that take longest (`make pytest` with --durations=0, summed per file, on the 2-core machine), slowest
# first. `make pytest` hands the two workers whole files in collection order (--dist loadfile
# --no-loadscope-reorder), so that these start first and no long file is left to start last on one worker while
# the other idles.
SLOW_FIRST = (  # measured 2026-12-03, one file at a time (pytest's total), on the 2-core machine shared with others:
    "tests/service/test_robustness.py",  # 52.7 s
    "tests/benchmarks/test_modes.py",  # 49.6 s
    "tests/benchmarks/test_smoke.py",  # 46.9 s (load 5)
    "tests/benchmarks/test_gpu_script.py",  # 45.8 s
    "tests/engine/frontend/test_async_engine.py",  # 39.7 s
    "tests/deploy/test_history_failover.py",  # 38.1 s
    "tests/service/test_history_restart.py",  # 37.9 s (load 4)
    "tests/engine/sample/test_schema_corpus.py",  # 37.8 s
    "tests/engine/kv_tiers/test_kv_tiers.py",  # 28.4 s
    "tests/deploy/test_smg_gateway.py",  # 16.9 s (smg killed at teardown, no longer 5 s of settle per stop)
    # Not measured again this time: the earlier quiet run's order.
    "tests/service/test_conversations.py",
    "tests/service/test_process_hardening.py",
    "tests/service/test_adapter_servicer.py",
    "tests/engine/core/test_engine_process.py",
    "tests/service/test_sessions_grpc.py",
    "tests/engine/backends/test_piecewise.py",
    "tests/engine/test_exactness.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first, in SLOW_FIRST's order; the rest as collected (a stable sort: each file's own order,
    which its module fixtures set, is kept)."""
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# make mutation (tests/mutation.py): the same examples for every mutant, none carried over from another mutant's
# failure, and no shrinking (a failure is all a mutation run needs to know).
settings.register_profile(
    "mutation", derandomize=True, database=None, phases=[Phase.explicit, Phase.reuse, Phase.generate]
)


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The default model's real tokenizer (converted once from the GGUF, then cached)."""
    from transformers import AutoTokenizer

    from llmserve.models.gguf import convert_gguf, default_gguf_path

    return AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()), local_files_only=True)


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct in float32 on the CPU."""
    from llmserve.models.loader import load_model

    return load_model(None, device="cpu", dtype="float32")


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    # Imported here, not at the top: `make pytest`'s xdist controller loads this file too and runs no test, so it
    # never loads torch (its start and exit took seconds each).
    import torch

    torch.manual_seed(0)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Nothing is collected after the session: the interpreter's teardown then skips the collections over every
    module object of torch and transformers (1.45 CPU-s per worker process at exit, 0.2 with this), which the
    controller waits out before it exits."""
    gc.freeze()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The files that took longest, each the sum of its tests' setup, call and teardown (its module fixtures'
    servers included), as the workers reported them: where a run's time goes, per file, for SLOW_FIRST and for
    cutting CI's time (`--durations` names single tests, and a file's server start lands in one of them)."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                path = report.nodeid.split("::", 1)[0]
                totals[path] = totals.get(path, 0.0) + report.duration
    if len(totals) < 2:
        return
    slowest = sorted(totals.items(), key=lambda item: -item[1])[:25]
    terminalreporter.write_sep("=", f"slowest files (sum of their tests, {sum(totals.values()):.0f} s in all)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
