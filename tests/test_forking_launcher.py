"""The tests' engine-process launcher (tests/forking_launcher.py): a forked engine process is one that
`python -m llmserve.engine.core.process` would have started, as ProcessCore sees it, and a launch falls back to the
fresh interpreter where the fork could differ."""

from __future__ import annotations

import functools
import os
import signal
import sys

import pytest

from llmserve.engine.core.process import ChildSpec, ProcessCore
from llmserve.engine.types.model import LoadedModel
from tests.engine.engine_helpers import CONFIG, tiny64
from tests.forking_launcher import ForkedChild, ForkingLauncher, forking_launcher


def _tiny64_where(environment: dict[str, str]) -> LoadedModel:
    """tiny64, built in an engine process whose environment holds `environment`, or its start fails. (Read there:
    /proc/PID/environ shows what a process was started with, which a fork shares with the zygote.)"""
    differs = sorted(name for name, value in environment.items() if os.environ.get(name) != value)
    if differs:
        raise AssertionError(f"the engine process's environment differs in {differs}")
    return tiny64()


def _fds(pid: int) -> dict[int, str]:
    folder = f"/proc/{pid}/fd"
    return {int(fd): os.readlink(f"{folder}/{fd}") for fd in os.listdir(folder)}


def test_a_forked_engine_process_serves_holds_only_its_own_ends_and_reports_its_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launcher = forking_launcher()
    with monkeypatch.context() as patch:  # the zygote runs, started (if by this launch) under another test's name
        patch.setenv("PYTEST_CURRENT_TEST", "an earlier test")
        ProcessCore(ChildSpec(tiny64, CONFIG), launcher).kill()
    forked = launcher.forked
    # This process's environment (this test's name included), standard output and error.
    here = {"PYTEST_CURRENT_TEST": os.environ["PYTEST_CURRENT_TEST"], "PYTHONPATH": os.pathsep.join(sys.path)}
    core = ProcessCore(ChildSpec(functools.partial(_tiny64_where, here), CONFIG), launcher)
    try:
        core.wait_ready()
        assert launcher.forked == forked + 1 and isinstance(core.process, ForkedChild), launcher.fallbacks
        pid = core.process.pid
        assert core.process.poll() is None and os.getppid() != pid
        fds = _fds(pid)
        assert fds[1] == os.readlink("/proc/self/fd/1") and fds[2] == os.readlink("/proc/self/fd/2")
        # Nothing of the zygote's: no socket (its requests), no pidfd or other child's status pipe.
        assert not [target for target in fds.values() if target.startswith("socket:") or "pidfd" in target]
        pipes = [fd for fd, target in fds.items() if target.startswith("pipe:")]
        assert len(pipes) == 2  # the commands' read end and the events' write end
        core.start(lambda outputs: None)
    finally:
        core.stop()
    assert core.process.returncode == 0


def test_a_killed_forked_engine_process_reads_as_popen_reads_a_signal() -> None:
    core = ProcessCore(ChildSpec(tiny64, CONFIG), forking_launcher())
    core.wait_ready()
    os.kill(core.process.pid, signal.SIGKILL)
    assert core.process.wait(10) == -9 and core.process.poll() == -9
    core.stop()  # the reader sees the pipe close and ends


def test_an_environment_other_than_the_zygotes_gets_a_fresh_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote imported torch, libgomp and the CPU level under its own environment: a launch under another (here
    a CPU cap, as the capped legs set) is not forked from it."""
    launcher = forking_launcher()
    ProcessCore(ChildSpec(tiny64, CONFIG), launcher).kill()  # the zygote runs (it starts on a first launch)
    fresh = launcher.fresh
    with monkeypatch.context() as patch:
        patch.setenv("LLMSERVE_CPU_ISA", "none")
        capped = functools.partial(_tiny64_where, {"LLMSERVE_CPU_ISA": "none"})
        core = ProcessCore(ChildSpec(capped, CONFIG), launcher)
        try:
            assert launcher.fresh == fresh + 1 and not isinstance(core.process, ForkedChild)
            assert launcher.fallbacks[-1] == "environment: LLMSERVE_CPU_ISA"
            core.wait_ready()
            core.start(lambda outputs: None)
        finally:
            core.stop()
        assert core.process.returncode == 0
    # Back to the zygote's environment: forked again.
    core = ProcessCore(ChildSpec(tiny64, CONFIG), launcher)
    assert isinstance(core.process, ForkedChild)
    core.kill()


def test_an_environment_that_stays_gets_a_zygote_of_its_own_and_the_old_one_still_reports_its_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A library imported after the zygote started may set a variable for good (scikit-learn sets KMP_*): the next
    launch under it starts fresh, the one after forks from a new zygote; an engine forked from the old one runs on
    and its exit is still reported. (A launcher of its own: the worker's keeps its zygote for the other tests.)"""
    launcher = ForkingLauncher()
    old = ProcessCore(ChildSpec(tiny64, CONFIG), launcher)
    old.wait_ready()
    assert isinstance(old.process, ForkedChild)
    monkeypatch.setenv("LLMSERVE_TEST_LIBRARY_SETTING", "1")
    first = ProcessCore(ChildSpec(tiny64, CONFIG), launcher)
    set_for_good = functools.partial(_tiny64_where, {"LLMSERVE_TEST_LIBRARY_SETTING": "1"})
    second = ProcessCore(ChildSpec(set_for_good, CONFIG), launcher)
    try:
        assert not isinstance(first.process, ForkedChild) and isinstance(second.process, ForkedChild)
        second.wait_ready()
    finally:
        first.kill()
        second.kill()
    old.start(lambda outputs: None)
    old.stop()
    assert old.process.returncode == 0
    launcher.close()
