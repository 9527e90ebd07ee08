"""`python tests/service/dying_llmserve.py ARGS...`: `python -m llmserve ARGS...` whose engine dies, as it
does after repeated failed forwards, once the file named by $LLMSERVE_TEST_KILL_FILE exists (looked at
every engine step). A test hook kept out of the production code; run it with --engine-in-process (the hook patches
this process's core)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from llmserve.__main__ import main
from llmserve.engine.core import engine_core as core

TRIGGER = Path(os.environ["LLMSERVE_TEST_KILL_FILE"])
_step = core.EngineCore.step


def _dying_step(self: core.EngineCore) -> None:
    if self.dead_reason is None and TRIGGER.exists():
        self._die("killed by the test (as after consecutive failed forwards)")
        return
    _step(self)


core.EngineCore.step = _dying_step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
