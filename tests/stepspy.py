"""A spy on a running engine's step loop, for tests that must see what the engine does after a cancel or a
deadline: which requests each step scheduled, and each request's final output as the engine produced it."""

from __future__ import annotations

import threading
import time
from typing import Any

from llmserve.engine.types.outputs import EngineOutput


class StepSpy:
    """Wraps `core.scheduler.schedule` and `core.take_outputs` of an EngineCore (the step thread may be running).

    `step_delay_s` slows every step down, so that a cancel's trip from the caller to the engine takes less
    than one step even on a loaded machine; "at most N steps after the cancel" then measures the engine.
    """

    def __init__(self, core: Any, step_delay_s: float = 0.0) -> None:
        self.steps: list[set[str]] = []
        self.finals: dict[str, EngineOutput] = {}
        self._lock = threading.Lock()
        real_schedule, real_take = core.scheduler.schedule, core.take_outputs

        def schedule() -> Any:
            out = real_schedule()
            with self._lock:
                self.steps.append({entry.seq.request_id for entry in out.seqs})
            if step_delay_s and out.seqs:
                time.sleep(step_delay_s)
            return out

        def take_outputs() -> list[EngineOutput]:
            outputs = real_take()
            with self._lock:
                self.finals.update((out.request_id, out) for out in outputs if out.finished)
            return outputs

        core.scheduler.schedule = schedule
        core.take_outputs = take_outputs
        self._core = core

    def restore(self) -> None:
        """Take the spy off (the instance attributes it set hide the class's methods)."""
        del self._core.scheduler.schedule
        del self._core.take_outputs

    def __enter__(self) -> StepSpy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    @property
    def num_steps(self) -> int:
        with self._lock:
            return len(self.steps)

    def steps_with(self, request_id: str, since: int = 0) -> int:
        """How many steps from step number `since` on scheduled the request."""
        with self._lock:
            return sum(request_id in ids for ids in self.steps[since:])

    def final(self, request_id: str, timeout: float = 10.0) -> EngineOutput | None:
        """The request's final output from the core, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if request_id in self.finals:
                    return self.finals[request_id]
            time.sleep(0.005)
        return None
