"""Engine processes for the tests' in-process servers, forked from an interpreter that has imported torch,
transformers and the engine once (a `Launch` for ProcessCore: llmserve.engine.core.process).

A fresh engine process spends 4.4 of its 4.7 CPU-s before Ready importing torch, transformers' modeling chain and
the engine (AMD EPYC Zen 4, the tiny model); a test run starts about 40 of them inside its workers, on two cores
that are already full. Here a pytest worker starts one preloaded interpreter (the "zygote", as Android calls its
own) on the first launch, and each launch forks it: the child runs the same `run_child` on the same two pipes that
`python -m llmserve.engine.core.process` would, with this process's environment, standard output and error. What
differs from a fresh interpreter is only when the modules were imported, so a launch falls back to the fresh
interpreter wherever that could show:
- the environment differs from the zygote's (a test that set LLMSERVE_CPU_ISA, an OpenMP variable, the import path):
  torch, libgomp and the CPU level read theirs when they load. An environment that stays (the same at the next
  launch: a library imported since set a variable of its own) gets a zygote of its own, and the old one exits once
  the children it forked have;
- the zygote has a Python thread besides its main one, or a native thread it did not have when its imports ended (a
  fork copies only the calling thread: an OpenMP pool would be lost in the child), or it has died. It has two native
  threads from its imports, OpenBLAS's servers (numpy's and scipy's copies), which OpenBLAS stops at a fork
  (pthread_atfork) and starts again when it next computes, in the child as in the zygote.
The servers that tests start as `python -m llmserve` subprocesses, and test_engine_process's fresh-interpreter test,
start their engine the product's own way.

The child is the zygote's, not this process's: the zygote reaps it and writes its exit status (Popen's
`returncode`) to a pipe whose read end it handed over with the pid; `ForkedChild` reads it.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading

from llmserve.engine.core.process import ChildProcess, child_environment, launch_interpreter

__all__ = ["ForkedChild", "ForkingLauncher", "forking_launcher"]

# What the zygote imports before it forks: the heavy part of what an engine process imports before Ready.
PRELOAD = ("llmserve.engine.core.engine_core", "llmserve.models.loader", "llmserve.engine.backends.cpu.backend")
# How long the zygote may take to import them and say so.
START_TIMEOUT_S = 120.0
# Per-test variables that pytest sets in the environment: they may differ from the zygote's.
PER_TEST = ("PYTEST_CURRENT_TEST",)


class ForkedChild:
    """A child of the zygote, as ProcessCore holds a Popen (ChildProcess)."""

    def __init__(self, pid: int, status: int) -> None:
        self._pid = pid
        self._status = status  # the read end of the pipe the zygote writes the exit status to
        self._returncode: int | None = None
        self._reading = threading.Lock()  # ProcessCore's reader thread and its caller may both wait

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def poll(self) -> int | None:
        if self._returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self._returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"engine process {self._pid}", timeout or 0.0)
            self._read_status()
        assert self._returncode is not None
        return self._returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _read_status(self) -> None:
        with self._reading:
            if self._returncode is None:
                self._read_status_once()

    def _read_status_once(self) -> None:
        text = b""
        while chunk := os.read(self._status, 64):
            text += chunk
        if not text:
            raise RuntimeError(f"the zygote ended before engine process {self._pid} did: its exit status is lost")
        self._returncode = int(text)

    def __del__(self) -> None:
        # Closed only here, so that no thread selects on it after another closed it (at its end, it reads as EOF).
        os.close(self._status)


class ForkingLauncher:
    """A Launch: forks the engine process from the zygote, or starts a fresh interpreter where a fork could differ
    from it (the module's docstring). Thread-safe; the zygote starts on the first launch and ends with this process
    (its socket closes)."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self._preload = preload
        self._lock = threading.Lock()
        self._zygote: subprocess.Popen[bytes] | None = None
        self._retired: list[subprocess.Popen[bytes]] = []  # zygotes still reporting on children they forked
        self._socket: socket.socket | None = None
        self._comparable: dict[str, str] = {}  # the zygote's environment, less PER_TEST
        self._last: dict[str, str] = {}  # the last launch's
        self.forked = 0  # launches served by a fork
        self.fresh = 0  # launches that fell back to a fresh interpreter
        self.fallbacks: list[str] = []  # why each fell back

    def __call__(self, commands: int, events: int) -> ChildProcess:
        environment = child_environment()
        with self._lock:
            comparable, last = _comparable(environment), self._last
            self._last = comparable
            if self._zygote is None or (comparable != self._comparable and comparable == last):
                # The first launch, or an environment that has stayed (a library imported since set a variable:
                # scikit-learn its KMP_*, torch's inductor its cache folder): a zygote imports under it.
                self._start(environment)
            if not self._alive():
                self.fallbacks.append("the zygote did not start, or ended")
            elif comparable != self._comparable:
                changed = sorted(
                    name
                    for name in comparable.keys() | self._comparable.keys()
                    if comparable.get(name) != self._comparable.get(name)
                )
                self.fallbacks.append(f"environment: {', '.join(changed)}")
            else:
                child = self._fork(commands, events, environment)
                if child is not None:
                    self.forked += 1
                    return child
        self.fresh += 1
        return launch_interpreter(commands, events)

    def _start(self, environment: dict[str, str]) -> None:
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._zygote = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from tests.forking_launcher import serve; serve({theirs.fileno()}, {self._preload!r})",
            ],
            pass_fds=(theirs.fileno(),),
            env=environment,
        )
        theirs.close()
        ours.settimeout(START_TIMEOUT_S)
        try:
            ready = ours.recv(64)
        except OSError:
            ready = b""
        ours.settimeout(None)
        if ready != b"ready":
            ours.close()
            return
        self._socket, self._comparable = ours, _comparable(environment)

    def close(self) -> None:
        """Retire the zygote: its socket closes, and it exits once the children it forked have (it reports their
        exit statuses until then)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._zygote is not None:
            self._retired.append(self._zygote)
            self._zygote = None

    def _alive(self) -> bool:
        return self._socket is not None and self._zygote is not None and self._zygote.poll() is None

    def _fork(self, commands: int, events: int, environment: dict[str, str]) -> ForkedChild | None:
        assert self._socket is not None
        try:
            socket.send_fds(self._socket, [pickle.dumps(environment)], [commands, events, 1, 2])
            answer, fds, _, _ = socket.recv_fds(self._socket, 64, 1)
        except OSError:
            return None
        if not answer.startswith(b"pid "):  # "threads": the zygote would lose a thread in the fork
            self.fallbacks.append("the zygote has threads")
            return None
        return ForkedChild(int(answer[4:]), fds[0])


@functools.cache
def forking_launcher() -> ForkingLauncher:
    """This process's launcher (one zygote per pytest worker)."""
    return ForkingLauncher()


def _comparable(environment: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in environment.items() if name not in PER_TEST}


# -- the zygote's side -------------------------------------------------------------------------------------------


def serve(fd: int, preload: tuple[str, ...]) -> None:
    """The zygote: import `preload`, say ready, then fork an engine process per request until the socket closes.
    Single-threaded (a fork copies only the calling thread); each child's end is watched through a pidfd."""
    import importlib
    import selectors

    for name in preload:
        importlib.import_module(name)
    from llmserve.engine.core import process

    imported_with = _threads()
    requests = socket.socket(fileno=fd)
    requests.send(b"ready")
    watch = selectors.DefaultSelector()
    watch.register(requests, selectors.EVENT_READ)
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, the status pipe's write end)
    while True:
        for key, _ in watch.select():
            if key.fileobj is requests:
                message, fds, _, _ = socket.recv_fds(requests, 1 << 20, 4)
                if not message:  # retired: no more requests, but the children's statuses are still owed
                    watch.unregister(requests)
                    requests.close()
                    if not children:
                        return
                    continue
                commands, events, stdout, stderr = fds
                if threading.active_count() > 1 or _threads() > imported_with:
                    requests.send(b"threads")
                else:
                    status_in, status_out = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        try:
                            requests.close()  # (open: this request came through it)
                            watch.close()
                            for pidfd, (_, status) in children.items():
                                os.close(pidfd)
                                os.close(status)
                            os.close(status_in)
                            os.close(status_out)
                            os.dup2(stdout, 1)
                            os.dup2(stderr, 2)
                            os.close(stdout)
                            os.close(stderr)
                            os.environ.clear()
                            os.environ.update(pickle.loads(message))
                            process.run_child(commands, events)
                        finally:
                            os._exit(1)
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = (pid, status_out)
                    watch.register(pidfd, selectors.EVENT_READ)
                    socket.send_fds(requests, [f"pid {pid}".encode()], [status_in])
                    os.close(status_in)
                for each in fds:
                    os.close(each)
            else:
                pidfd = key.fd
                pid, status = children.pop(pidfd)
                watch.unregister(pidfd)
                os.close(pidfd)
                _, code = os.waitpid(pid, 0)
                os.write(status, str(os.waitstatus_to_exitcode(code)).encode())
                os.close(status)
                if not children and requests.fileno() == -1:
                    return


def _threads() -> int:
    """This process's threads, OpenMP's and other native ones included."""
    return len(os.listdir("/proc/self/task"))
