"""A tracer of the llmserve files a call enters, installed in a process as its `sitecustomize`.

tests/service/test_generate_walk.py copies this file as `sitecustomize.py` into a folder of its own, puts the folder
first on PYTHONPATH and names it in LLMSERVE_WALK_TRACE: Python imports it at start in the server process and in the
engine process (which inherits the server's path and environment), before any thread starts, so that every thread
gets the profile function. The function does nothing until the folder holds a file named `on` (a poller thread of
this module looks every few milliseconds and answers `ready-<pid>`), then notes the first entry into each file under
LLMSERVE_WALK_ROOT (module bodies left out: an import is start-up work) with the time and the functions on the stack;
once `off` appears it writes `trace-<pid>.json` and stops. A process notes nothing until the call reaches it: the
server at the interceptor's `intercept_service`, the engine process at `EngineCore.submit` (from its pipe reader).
Both have work that wakes when idle (the engine's step loop twice a second, the server's periodic tasks), and a wake
between `on` and the call listed its files first: a fresh-clone CI run failed on that order (the engine's), and a
planted 1.2-s pause before the call fails it without this start (the server's order too). Nothing here is product
code: no module of llmserve knows of it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

FOLDER = os.environ.get("LLMSERVE_WALK_TRACE")
ROOT = os.environ.get("LLMSERVE_WALK_ROOT", "")

_active = False
# where a process starts noting: the call reaching it (the engine process runs `-m llmserve.engine.core.process`)
if "llmserve.engine.core.process" in getattr(sys, "orig_argv", ()):
    START = (os.path.join(ROOT, "engine", "core", "engine_core.py"), "submit")
else:
    START = (os.path.join(ROOT, "api", "interceptor.py"), "intercept_service")
_started = False
_seen: set[Any] = set()  # code objects already looked at
_first: dict[str, dict[str, Any]] = {}  # file -> its first entry: time (ns, monotonic), the stack's functions


def _profile(frame: FrameType, event: str, arg: object) -> None:
    global _started
    if not _active or event != "call":
        return
    code = frame.f_code
    if not _started:
        if (code.co_filename, code.co_name) != START:
            return
        _started = True
    if code in _seen:
        return
    _seen.add(code)
    name = code.co_filename
    if name in _first or not name.startswith(ROOT) or code.co_name == "<module>":
        return
    stack = []
    caller: FrameType | None = frame
    while caller is not None:
        stack.append(f"{caller.f_code.co_filename}:{caller.f_code.co_name}")
        caller = caller.f_back
    _first[name] = {"ns": time.monotonic_ns(), "function": code.co_name, "stack": stack}


def _poll(folder: str) -> None:
    global _active
    on, off = os.path.join(folder, "on"), os.path.join(folder, "off")
    while not os.path.exists(on):
        time.sleep(0.005)
    _active = True
    with open(os.path.join(folder, f"ready-{os.getpid()}"), "w"):
        pass
    while not os.path.exists(off):
        time.sleep(0.005)
    _active = False
    tmp = os.path.join(folder, f".trace-{os.getpid()}")
    with open(tmp, "w") as out:
        json.dump(_first, out)
    os.rename(tmp, os.path.join(folder, f"trace-{os.getpid()}.json"))


if FOLDER and ROOT:
    threading.Thread(target=_poll, args=(FOLDER,), daemon=True, name="walk-tracer").start()
    threading.setprofile(_profile)
    sys.setprofile(_profile)
