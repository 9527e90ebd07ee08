"""The walk of one Generate call that docs/architecture.md shows is the list of llmserve files the call enters.

The default mode, as `make run` starts it (`python -m llmserve`: the shipped SmolLM2 Q4_1 served from its blocks on
the CPU, the engine in a process of its own), with a tracer installed in both processes as their `sitecustomize`
(walk_tracer.py, copied into a folder of this test's that it puts first on PYTHONPATH: no product code carries a
hook). The server is the product's own process, not the engine in-process: a profile function installed before start
reaches the engine process too, so the walk includes the pipe between the two. One flag differs from `make run`:
`--history-store memory`, so that the test writes no file in the model cache (a call without a session never touches
the store). Tracing starts once the server is serving and stops once the call has returned; every llmserve file
entered in between (a function of it called; module bodies, which are imports, left out) is listed in the order of
its first entry, one list per process, each from the call reaching it (walk_tracer.py: the processes' idle wakes are
not the call's). A file first entered below the CPU backend's model forward is one of the
forward's kernels: those count apart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from server_process import ServerProcess

from llmserve_client import Client, pb

pytestmark = [pytest.mark.real_model]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PACKAGE = REPO / "server" / "llmserve"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# The CPU backend's model forward (cpu/backend.py's FusedCpuForward): a file first entered below it is part of the
# forward's kernels.
FORWARD = {"engine/backends/cpu/backend.py:logits", "engine/backends/cpu/backend.py:pooled"}

# Issue 53's bounds on the files one call enters (without the forward's kernels, and with them).
MAX_FILES = 20
MAX_WITH_FORWARD = 26

Walk = dict[str, list[str]]  # process ("server", "engine") -> its files in first-entry order, "  (forward)" marked


def documented_walk() -> Walk:
    """docs/architecture.md's walk: the fenced block after its `<!-- traced walk -->` marker, a line naming a
    process ("server process", "engine process") before that process's numbered files."""
    match = re.search(r"<!-- traced walk -->\s*```text\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    assert match is not None, "docs/architecture.md has no traced walk block"
    walk: Walk = {}
    process = None
    for line in match.group(1).splitlines():
        if heading := re.fullmatch(r"(\w+) process", line.strip()):
            process = heading.group(1)
            walk[process] = []
        elif line.strip():
            assert process is not None, line
            walk[process].append(re.sub(r"^\s*\d+\.\s*", "", line).rstrip())
    return walk


def traced_walk(tmp_path: Path) -> Walk:
    """One greedy Generate call to the default server, traced in both processes."""
    folder = tmp_path / "tracer"
    folder.mkdir()
    shutil.copy(HERE / "walk_tracer.py", folder / "sitecustomize.py")
    prefix = str(PACKAGE) + os.sep
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p),
        "LLMSERVE_WALK_TRACE": str(folder),
        "LLMSERVE_WALK_ROOT": prefix,
    }
    server = ServerProcess("--history-store", "memory", env=env)
    try:
        port = server.wait_serving(timeout=300)
        (folder / "on").touch()
        deadline = time.monotonic() + 60
        while len(list(folder.glob("ready-*"))) < 2:
            assert time.monotonic() < deadline, "the tracer did not start in both processes"
            time.sleep(0.01)
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            responses = list(client.generate("The capital of France is", max_new_tokens=8))
        (folder / "off").touch()
        while len(list(folder.glob("trace-*.json"))) < 2:
            assert time.monotonic() < deadline + 60, "the tracer did not write both processes' lists"
            time.sleep(0.01)
        server_pid = server.proc.pid
    finally:
        server.kill()
    assert responses[-1].finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
    walk: Walk = {}
    for trace in sorted(folder.glob("trace-*.json")):
        entries = json.loads(trace.read_text())
        process = "server" if trace.name == f"trace-{server_pid}.json" else "engine"

        def listed(name: str, entries: dict = entries) -> str:
            below = (frame.removeprefix(prefix) for frame in entries[name]["stack"][1:])
            return name.removeprefix(prefix) + ("  (forward)" if any(f in FORWARD for f in below) else "")

        walk[process] = [listed(name) for name in sorted(entries, key=lambda name: entries[name]["ns"])]
    assert set(walk) == {"server", "engine"}
    return walk


def counts(walk: Walk) -> tuple[int, int]:
    """(files without the forward's kernels, files in all): each file once, whichever process entered it."""
    files = {line.removesuffix("  (forward)") for lines in walk.values() for line in lines}
    forward = {line.removesuffix("  (forward)") for lines in walk.values() for line in lines if "(forward)" in line}
    return len(files - forward), len(files)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Walk:
    return traced_walk(tmp_path_factory.mktemp("walk"))


def documented_counts() -> tuple[int, int]:
    """The counts docs/architecture.md states under its walk: "N files without the forward's kernels, M with them"."""
    match = re.search(r"(\d+) files without the forward's kernels, (\d+) with them", ARCHITECTURE.read_text())
    assert match is not None, "docs/architecture.md states no count of its walk"
    return int(match.group(1)), int(match.group(2))


def test_the_documented_walk_is_the_traced_one(traced: Walk) -> None:
    assert traced == documented_walk(), "\n".join(
        f"{process} process\n" + "\n".join(f"{i + 1:2}. {f}" for i, f in enumerate(files))
        for process, files in traced.items()
    )


def test_the_documented_counts_are_the_traced_ones(traced: Walk) -> None:
    assert counts(traced) == documented_counts()


@pytest.mark.xfail(
    strict=True,
    reason="issue 53's bounds are not met yet: docs/architecture.md says what the walk counts and what blocks it",
)
def test_the_walk_is_within_issue_53s_bounds(traced: Walk) -> None:
    without, with_forward = counts(traced)
    assert without <= MAX_FILES and with_forward <= MAX_WITH_FORWARD, (without, with_forward)
