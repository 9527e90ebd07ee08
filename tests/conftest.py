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

# The files that take longest, slowest first: the per-file sums (the summary at the end of a run, below) of `make
# pytest` on 2026-12-07 (AMD EPYC Zen 4, 2 cores, both workers busy: 882 worker-s in all, 449 s of wall), with the
# in-worker engine processes forked (tests/forking_launcher.py). `make pytest` hands the two workers whole files in
# collection order (--dist loadfile --no-loadscope-reorder), so that these start first and no long file is left to
# start last on one worker while the other idles.
SLOW_FIRST = (
    "tests/benchmarks/test_modes.py",  # 53.1 s
    "tests/engine/sample/test_schema_corpus.py",  # 42.4 s
    "tests/service/test_robustness.py",  # 36.0 s
    "tests/deploy/test_history_failover.py",  # 34.0 s
    "tests/service/test_conversations.py",  # 30.9 s
    "tests/service/test_history_restart.py",  # 29.1 s
    "tests/engine/backends/cpu/test_backend.py",  # 28.5 s
    "tests/benchmarks/test_smoke.py",  # 27.3 s
    "tests/engine/backends/test_piecewise.py",  # 24.6 s
    "tests/benchmarks/test_gpu_script.py",  # 22.6 s
    "tests/models/test_encoder.py",  # 21.7 s
    "tests/engine/backends/test_lora_slots.py",  # 21.4 s
    "tests/service/test_process_hardening.py",  # 21.1 s
    "tests/engine/test_exactness.py",  # 20.5 s
    "tests/service/test_cross_encoder.py",  # 20.4 s
    "tests/engine/backends/cpu/test_gguf_backend.py",  # 20.0 s
    "tests/engine/backends/cpu/test_dtype_accuracy.py",  # 20.0 s
    "tests/engine/kv_tiers/test_kv_tiers.py",  # 19.7 s
    "tests/deploy/test_smg_gateway.py",  # 19.7 s
    "tests/service/test_adapter_servicer.py",  # 18.1 s
    "tests/service/test_app_lifecycle.py",  # 17.2 s
    "tests/engine/core/test_engine_process.py",  # 16.3 s
    "tests/service/test_embed.py",  # 16.0 s
    "tests/deploy/test_nginx_affinity.py",  # 14.3 s
    "tests/service/test_vllm_servicer.py",  # 14.1 s
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
