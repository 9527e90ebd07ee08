"""`make mutation`: mutmut over the book-keeping and control modules, one module at a time, each against the test
files that cover it (so that a run fits a 2-core machine). Not part of `make test`.

    python tests/mutation.py [MODULE ...]     # default: every module below, in this order

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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_TESTS = "tests/engine"
SERVICE_TESTS = "tests/service"

# module -> (its file under server/llmserve, the test files that exercise it)
MODULES: dict[str, tuple[str, list[str]]] = {
    "block_pool": ("engine/block_pool.py", [f"{ENGINE_TESTS}/test_block_pool.py", f"{ENGINE_TESTS}/test_scheduler.py"]),
    "sessions": ("engine/sessions.py", [f"{ENGINE_TESTS}/test_sessions.py", f"{ENGINE_TESTS}/test_scheduler.py"]),
    "scheduler": ("engine/scheduler.py", [f"{ENGINE_TESTS}/test_scheduler.py", f"{ENGINE_TESTS}/test_sessions.py"]),
    "sampler": ("engine/sampler.py", [f"{ENGINE_TESTS}/test_sampler.py"]),
    "detokenizer": ("engine/detokenizer.py", [f"{ENGINE_TESTS}/test_detokenizer.py"]),
    "core": ("engine/core.py", [f"{ENGINE_TESTS}/test_core.py"]),
    "service": (
        "service.py",
        [
            f"{SERVICE_TESTS}/test_service_generate.py",
            f"{SERVICE_TESTS}/test_service_errors.py",
            f"{SERVICE_TESTS}/test_sessions_grpc.py",
            f"{SERVICE_TESTS}/test_conversations.py",
        ],
    ),
}
# mutmut's exit codes that count as the mutant detected (a test failed, crashed or hung).
DETECTED = {"killed", "timeout", "segfault", "suspicious"}


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


def run_one(name: str, jobs: int) -> None:
    """Run in a process of its own: mutmut keeps its state in module globals."""
    file, tests = MODULES[name]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    os.chdir(ROOT)
    from mutmut.__main__ import _run
    from mutmut.configuration import config
    from mutmut.mutation.data import SourceFileMutationData

    # A different selection than the last run's makes mutmut recollect which tests call which function.
    config().pytest_add_cli_args_test_selection = tests
    start = time.monotonic()
    try:
        _run([f"{module_name(file)}.*"], jobs)
    except SystemExit as exc:
        if exc.code:
            raise
    wall = time.monotonic() - start

    from mutmut.stats import status_by_exit_code

    data = SourceFileMutationData(path=Path("src/llmserve") / file)
    data.load()
    statuses = {key: status_by_exit_code[code] for key, code in data.exit_code_by_key.items()}
    counts = Counter(statuses.values())
    detected = sum(counts[s] for s in DETECTED)
    print(f"\n{name}: {detected} / {len(statuses)} mutants detected ({dict(counts)}), {wall:.0f} s wall")
    for key, status in sorted(statuses.items()):
        if status not in DETECTED:
            print(f"  {status}: {key}")


def main(argv: list[str]) -> int:
    jobs = int(os.environ.get("MUTATION_JOBS", "2"))
    if argv[:1] == ["--one"]:
        run_one(argv[1], jobs)
        return 0
    names = argv or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        print(f"unknown module(s) {unknown}; choose from {list(MODULES)}", file=sys.stderr)
        return 2
    prepare()
    for name in names:
        subprocess.run([sys.executable, __file__, "--one", name], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
