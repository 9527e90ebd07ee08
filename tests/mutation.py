"""`make mutation`: mutmut over the book-keeping and control modules, one module at a time, each against the test
files that cover it (so that a run fits a 2-core machine). Not part of `make test`.

    python tests/mutation.py [MODULE ...]           # default: every module below, in this order
    python tests/mutation.py --again [MODULE ...]   # only the mutants that survived the module's last run
    python tests/mutation.py --resume [MODULE ...]  # only the mutants that have no result yet (an interrupted run)

mutmut is configured in pyproject.toml ([tool.mutmut]); this script links src -> server (mutmut names mutants after
their path and knows only a src/ layout), narrows the test selection to the module's files, runs the module's
mutants and prints its score and survivors. Afterwards `mutmut show NAME` prints a mutant's diff and `mutmut browse`
walks the last module's results. Scores and the reasons survivors are harmless: tests/MUTATION.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_TESTS = "tests/engine"
SERVICE_TESTS = "tests/service"

# module -> (its file under server/llmserve, the pytest arguments that select the tests that exercise it). The
# book-keeping runs without a model: its engine-level tests would only make each mutant slower.
MODULES: dict[str, tuple[str, list[str]]] = {
    "block_pool": (
        "engine/sched/block_pool.py",
        [f"{ENGINE_TESTS}/sched/test_block_pool.py", f"{ENGINE_TESTS}/sched/test_scheduler.py"],
    ),
    "sessions": (
        "engine/sched/sessions.py",
        [
            f"{ENGINE_TESTS}/sched/test_sessions.py",
            f"{ENGINE_TESTS}/sched/test_scheduler.py",
            "-k",
            "scheduler or test_store_",
        ],
    ),
    "scheduler": ("engine/sched/scheduler.py", [f"{ENGINE_TESTS}/sched/test_scheduler.py"]),
    "fanout": ("engine/frontend/fanout.py", [f"{ENGINE_TESTS}/frontend/test_fanout.py"]),
    "sampler": ("engine/sample/sampler.py", [f"{ENGINE_TESTS}/sample/test_sampler.py"]),
    # Its real_model tests need only the default model's tokenizer.
    "detokenizer": ("engine/frontend/detokenizer.py", [f"{ENGINE_TESTS}/frontend/test_detokenizer.py"]),
    "core": (
        "engine/core/engine_core.py",
        [f"{ENGINE_TESTS}/core/test_engine_core.py", f"{ENGINE_TESTS}/frontend/test_async_engine.py"],
    ),
    "output_processor": (
        "engine/frontend/output_processor.py",
        [f"{ENGINE_TESTS}/frontend/test_output_processor.py", f"{ENGINE_TESTS}/core/test_engine_core.py"],
    ),
    "servicer": (
        "api/servicer.py",
        [
            f"{SERVICE_TESTS}/test_service_generate.py",
            f"{SERVICE_TESTS}/test_service_errors.py",
            f"{SERVICE_TESTS}/test_sessions_grpc.py",
            f"{SERVICE_TESTS}/test_conversations.py",
            f"{SERVICE_TESTS}/test_metrics.py",  # what the call observers are told
            f"{SERVICE_TESTS}/test_identity_scoping.py",  # session keys and request ids per identity
            f"{SERVICE_TESTS}/test_input_limits.py",  # the limits the servicer applies before tokenizing
            f"{SERVICE_TESTS}/test_request_log.py",  # the record each call leaves (status, finish, prompt)
            f"{SERVICE_TESTS}/test_auth.py",  # the caller's identity through the interceptor
            f"{SERVICE_TESTS}/test_tracing.py",  # what the span of each call says
            f"{SERVICE_TESTS}/test_robustness.py::test_a_stalled_reader_is_aborted_and_frees_its_slot",  # its log
            "tests/api/test_servicer.py",  # its own logic without a server (the engine request, endings, observers)
            "-m",
            "not real_model",
        ],
    ),
}
# Seconds added to a mutant's time budget (mutmut's timeout_constant) where the tests build a model or start a server
# first: mutmut times only the test calls, not their fixtures, and a fixture that outlasts the budget reads as a hang.
SETUP_S = {"core": 10.0, "servicer": 30.0}
# mutmut statuses that count as the mutant detected: a test failed, crashed or hung ("suspicious" does not count).
DETECTED = {"killed", "timeout", "segfault"}


def module_name(file: str) -> str:
    return "llmserve." + file.removesuffix(".py").replace("/", ".")


def prepare() -> None:
    """The src -> server link, and the package's non-Python files (the compiled kernels) fresh in mutants/: mutmut
    copies those only when they are missing."""
    src = ROOT / "src"
    if not src.is_symlink():
        if src.exists():
            sys.exit("src exists and is not the link to server/ that mutmut needs: move it away")
        src.symlink_to("server")
    copy = ROOT / "mutants" / "src" / "llmserve"
    if not copy.is_dir():
        return
    for path in (ROOT / "server" / "llmserve").rglob("*"):
        if path.is_file() and path.suffix not in (".py", ".pyc"):
            target = copy / path.relative_to(ROOT / "server" / "llmserve")
            if target.exists() and target.stat().st_mtime != path.stat().st_mtime:
                target.unlink()


def unfinished(file: str) -> list[str]:
    """The module's mutants that have no result in mutants/ (an interrupted run); all of them when it never ran."""
    from mutmut.mutation.data import SourceFileMutationData

    data = SourceFileMutationData(path=Path("src/llmserve") / file)
    if not data.meta_path.exists():
        return [f"{module_name(file)}.*"]
    data.load()
    return sorted(key for key, code in data.exit_code_by_key.items() if code is None)


def run_one(name: str, mode: str, jobs: int) -> None:
    """Run in a process of its own: mutmut keeps its state in module globals. mode "all": every mutant; "again": only
    the mutants that survived the module's last run (mutants/NAME.survivors), e.g. after adding tests; "resume": only
    those without a result."""
    file, tests = MODULES[name]
    survivors_file = ROOT / "mutants" / f"{name}.survivors"
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    os.chdir(ROOT)
    from mutmut.__main__ import _run
    from mutmut.configuration import config
    from mutmut.mutation.data import SourceFileMutationData

    if mode == "again":
        names = survivors_file.read_text().split()
    elif mode == "resume":
        names = unfinished(file)
    else:
        names = [f"{module_name(file)}.*"]
    if not names:
        print(f"{name}: no mutants left to run ({mode})")
        return
    again = mode == "again"

    # A different selection than the last run's makes mutmut recollect which tests call which function.
    config().pytest_add_cli_args_test_selection = tests
    config().timeout_constant = SETUP_S.get(name, config().timeout_constant)
    start = time.monotonic()
    try:
        _run(names, jobs)
    except SystemExit as exc:
        if exc.code:
            raise
    wall = time.monotonic() - start

    from mutmut.stats import status_by_exit_code

    data = SourceFileMutationData(path=Path("src/llmserve") / file)
    data.load()
    statuses = {key: status_by_exit_code[code] for key, code in data.exit_code_by_key.items()}
    if again:
        statuses = {key: status for key, status in statuses.items() if any(fnmatch(key, n) for n in names)}
    counts = Counter(statuses.values())
    detected = sum(counts[s] for s in DETECTED)
    what = "of the last run's survivors" if again else "mutants"
    print(f"\n{name}: {detected} / {len(statuses)} {what} detected ({dict(counts)}), {wall:.0f} s wall")
    survivors = sorted(key for key, status in statuses.items() if status not in DETECTED)
    for key in survivors:
        print(f"  {statuses[key]}: {key}")
    survivors_file.write_text("".join(f"{key}\n" for key in survivors))


def main(argv: list[str]) -> int:
    jobs = int(os.environ.get("MUTATION_JOBS", "2"))
    if argv[:1] == ["--one"]:
        run_one(argv[2], argv[1], jobs)
        return 0
    mode = {"--again": "again", "--resume": "resume"}.get(argv[0] if argv else "", "all")
    names = argv[mode != "all" :] or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        print(f"unknown module(s) {unknown}; choose from {list(MODULES)}", file=sys.stderr)
        return 2
    prepare()
    for name in names:
        subprocess.run([sys.executable, __file__, "--one", mode, name], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
