"""The engine core's book of requests waiting for their grammar: each constrained `Add` until its matcher exists.

The core hands every constrained Add here; its spec goes to the compiler (constraints.ConstraintCompiler, cached,
on worker threads), and the Add waits until the compile has ended. Each drain of the inbox takes the ones that
are ready, in the order they came (so completion 0 of an n > 1 request before the others, which share its prompt's
KV), each with its own grammar state or the reason it did not compile. A compile that ends wakes the step loop.
Book-keeping only: the futures and the commands, no engine state.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from llmserve.engine.core.client import Add
from llmserve.engine.sample.constraints import Compiled, ConstraintCompiler, ConstraintState
from llmserve.engine.types.request import ConstraintSpec


class Compiling:
    """Constrained Adds by handle, in arrival order. `compiler` None: the model has no tokenizer."""

    def __init__(self, compiler: ConstraintCompiler | None, wake: Callable[[], None]) -> None:
        self.compiler = compiler
        self._wake = wake
        self._waiting: dict[int, tuple[Add, Future[Compiled]]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, command: Add, spec: ConstraintSpec) -> None:
        if self.compiler is None:
            future: Future[Compiled] = Future()
            future.set_exception(ValueError("the model has no tokenizer: constraints need one"))
        else:
            future = self.compiler.submit(spec)
        self._waiting[command.handle] = (command, future)
        if not future.done():
            future.add_done_callback(lambda _: self._wake())

    def ready(self) -> list[tuple[Add, ConstraintState | str]]:
        """The Adds whose compile has ended, in arrival order, taken out of the book: each with a fresh grammar
        state, or why its constraint did not compile."""
        done: list[tuple[Add, ConstraintState | str]] = []
        for command, future in self._waiting.values():
            if future.done():
                try:
                    done.append((command, future.result().start()))
                except Exception as exc:
                    done.append((command, f"its constraint did not compile: {exc}"))
        for command, _ in done:
            del self._waiting[command.handle]
        return done

    def pop(self, handle: int) -> Add | None:
        """Take a waiting Add out (aborted); None if `handle` is not waiting."""
        entry = self._waiting.pop(handle, None)
        return None if entry is None else entry[0]

    def expired(self, now: float) -> list[Add]:
        """The waiting Adds whose deadline has passed, taken out of the book."""
        late = [c for c, _ in self._waiting.values() if c.request.deadline is not None and c.request.deadline <= now]
        for command in late:
            del self._waiting[command.handle]
        return late

    def take_all(self) -> list[Add]:
        """Every waiting Add, taken out (the core stops or dies)."""
        commands = [command for command, _ in self._waiting.values()]
        self._waiting.clear()
        return commands

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
