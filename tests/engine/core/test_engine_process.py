"""The engine core in a process of its own (core/process.py) behind AsyncEngine: the
same tokens and books as the core on a thread, stop strings and constraints across the pipe, the child's failure at
start, a clean exit, a front end that falls behind, and a session command that races the child's loss. What both
cores promise alike (death, stop, session queries, counts) is tested over both in test_async_engine.py."""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import os
import signal
import textwrap
import time

import pytest

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.client import Core
from llmserve.engine.core.engine_core import ThreadCore
from llmserve.engine.core.process import ChildSpec, ProcessCore
from llmserve.engine.frontend.async_engine import build_engine
from llmserve.engine.types.errors import EngineDead
from llmserve.engine.types.outputs import FinishReason
from llmserve.engine.types.request import (
    ConstraintKind,
    ConstraintSpec,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)
from llmserve.models.loader import load_model
from llmserve.telemetry.metrics import EngineCollector
from tests.engine.engine_helpers import CONFIG, RUN_TIMEOUT_S, req, run, start_engine, tiny64


async def wait_for(predicate, timeout: float = RUN_TIMEOUT_S) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


def by_completion(deltas: list) -> dict[int, list[int]]:
    """Each completion's tokens (an n > 1 stream interleaves them as they come)."""
    tokens: dict[int, list[int]] = {}
    for delta in deltas:
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
    return tokens


def requests() -> list[GenerationRequest]:
    seeded = [req(f"s{i}", [3, 4, 5 + i], sampling=SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    greedy = [req(f"g{i}", list(range(1, 20 + 9 * i)), max_new=12) for i in range(4)]
    return [*seeded, *greedy, req("n", [7, 8, 9], max_new=6, n=2, sampling=SamplingParams(temperature=0.8, seed=5))]


async def test_the_engine_process_serves_what_the_thread_serves_and_keeps_its_books() -> None:
    here = await start_engine("thread")
    try:
        expected = await asyncio.gather(*(run(here, r) for r in requests()))
    finally:
        await here.shutdown()
    engine = await start_engine("process")
    core = engine.core
    assert isinstance(core, ProcessCore)
    try:
        got = await asyncio.gather(*(run(engine, r) for r in requests()))
        assert [by_completion(d) for _, d in got] == [by_completion(d) for _, d in expected]
        assert [d[-1].finish_reason for _, d in got] == [FinishReason.LENGTH] * len(got)
        # (cached_prompt_tokens depends on which prompt's blocks were cached first: timing, not the process)
        usage = [[(d[-1].usage.prompt_tokens, d[-1].usage.completion_tokens) for _, d in r] for r in (got, expected)]
        assert usage[0] == usage[1]
        assert engine.model_info.context_length == 512 and engine.model_info.backend.startswith("cpu")
        # The scrape reports the engine process's memory (this process's own is process_resident_memory_bytes).
        gauges = {m.name: m.samples[0].value for m in EngineCollector(lambda: engine, lambda: 0).collect()}
        assert engine.engine_pid == core.process.pid != os.getpid()
        assert gauges["llmserve_engine_process_resident_memory_bytes"] > 10 * 2**20

        # Sessions: the child's books, asked through the pipe.
        await run(engine, req("turn", [1, 2, 3, 4], max_new=5, session_id="conv"))
        info = await engine.get_session("conv")
        assert info is not None and info.cached_tokens == 4 + 5 - 1
        assert engine.stats().sessions == 1
        assert await engine.delete_session("conv") and await engine.get_session("conv") is None

        # Shutdown: what still runs ends CANCELLED, with its usage, and the child exits on its own.
        long = asyncio.ensure_future(run(engine, req("long", [6] * 10, max_new=480)))
        await wait_for(lambda: engine.num_running == 1)
    finally:
        await engine.shutdown()
    tokens, deltas = await long
    assert deltas[-1].finish_reason is FinishReason.CANCELLED
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == len(tokens)
    assert core.process.wait(10) == 0


async def test_a_child_that_cannot_start_raises_its_own_error() -> None:
    load = functools.partial(load_model, "random:no-such-shape")
    with pytest.raises(ValueError, match="no-such-shape"):
        await build_engine(load, CONFIG, ProcessCore(ChildSpec(load, CONFIG)))


@pytest.mark.real_model
async def test_stop_strings_and_constraints_cross_the_process() -> None:
    """The front end finds the stop string and stops the child's request at what the caller was sent (the session
    keeps exactly that); a constraint checked here is compiled there, and the answer keeps to it."""
    config = EngineConfig(block_size=16, kv_cache_tokens=8192, max_num_seqs=8, max_num_batched_tokens=256)
    stopping = StoppingParams(max_new_tokens=40, stop_sequences=(" 6",))

    engine = await start_engine("process", load_model, config)
    try:
        ids = tuple(engine.tokenizer.encode("Count: 1, 2, 3,"))
        _, deltas = await run(engine, GenerationRequest("stop", ids, stopping=stopping, session_id="c"))
        assert deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE
        assert "".join(d.text for d in deltas) == " 4, 5,"
        # The session holds the tokens the caller was sent, no more (the last one's KV may not be computed yet).
        sent = len(ids) + deltas[-1].usage.completion_tokens
        info = await engine.get_session("c")
        assert info is not None and sent - 1 <= info.cached_tokens <= sent

        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        constraint = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        prompt = tuple(engine.tokenizer.encode("A JSON object with a number n:"))
        answers = await asyncio.gather(
            *(
                run(engine, GenerationRequest(f"j{i}", prompt, stopping=StoppingParams(max_new_tokens=30),
                                              sampling=SamplingParams(temperature=1.0, seed=i), constraint=constraint))
                for i in range(3)
            )
        )  # fmt: skip
        for _, deltas in answers:
            if deltas[-1].finish_reason is FinishReason.CONSTRAINT:
                assert isinstance(json.loads("".join(d.text for d in deltas))["n"], int)
            else:
                assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert any(d[-1].finish_reason is FinishReason.CONSTRAINT for _, d in answers)
    finally:
        await engine.shutdown()


async def test_a_front_end_that_falls_behind_gets_the_passes_merged() -> None:
    """An emit that takes longer than a step: the passes that queued meanwhile come as one batch, in order, and
    no token is lost."""
    core = ProcessCore(ChildSpec(tiny64, CONFIG))
    await asyncio.to_thread(core.wait_ready)
    batches: list[list] = []

    def slow_emit(outputs: list) -> None:
        batches.append(outputs)
        time.sleep(0.05)

    core.start(slow_emit)
    try:
        handles = [core.add(req(f"r{i}", [3, 4, 5 + i], max_new=60)) for i in range(4)]
        await wait_for(lambda: sum(o.finish_reason is not None for b in batches for o in b) == 4)
    finally:
        await asyncio.to_thread(core.stop)
    tokens = {h: [t for b in batches for o in b if o.handle == h for t in o.token_ids] for h in handles}
    assert all(len(t) == 60 for t in tokens.values())
    assert len(batches) < 60  # 60 passes at least, merged into fewer batches
    assert any(len({o.handle for o in b}) < len(b) for b in batches)  # a batch held two passes of one request


class _LosesItsChildAtTheCheck(ProcessCore):
    """A ProcessCore whose engine process is killed (SIGKILL) the moment a session command, once `armed`, has found
    the core alive: the loss falls between that check and the registration of the command's future. Where the
    check holds the lock that the reader's ending takes, the reader ends the core after this section (and so after
    the registration); where it does not, nothing keeps the reader from ending the core at once, and it is joined
    here before the check returns (the interleaving the old client allowed: checked, lost, then registered)."""

    armed = False
    lost_in_the_lock: bool | None = None  # how the loss ran, once it has

    @property
    def _ended(self) -> str | None:
        ended = self.__dict__["_ended"]
        if self.armed:
            self.armed = False
            held = not self._lock.acquire(blocking=False)  # idle, nobody else takes it: held by this thread
            if not held:
                self._lock.release()
            os.kill(self.process.pid, signal.SIGKILL)
            if not held:
                assert self._reader is not None
                self._reader.join(RUN_TIMEOUT_S)
            self.lost_in_the_lock = held
        return ended

    @_ended.setter
    def _ended(self, why: str | None) -> None:
        self.__dict__["_ended"] = why


@pytest.mark.parametrize("command", ["get_session", "delete_session"])
def test_a_session_command_that_races_the_loss_of_the_child_fails_and_is_never_left_pending(command: str) -> None:
    """The child dies after the command found the core alive and before its future is registered: the future
    still fails with EngineDead (the check and the registration are one step under the lock the ending takes), it
    is not left pending for ever. Deterministic: the loss runs at that exact point (_LosesItsChildAtTheCheck)."""
    core = _LosesItsChildAtTheCheck(ChildSpec(tiny64, CONFIG))
    core.wait_ready()
    core.start(lambda outputs: None)
    try:
        assert getattr(core, command)("before").result(RUN_TIMEOUT_S) in (None, False)  # alive: answered
        core.armed = True
        reply = getattr(core, command)("racing")
        assert core.lost_in_the_lock is not None  # the loss ran between the check and the registration
        error = reply.exception(10)  # raises TimeoutError if the future was left pending
        assert isinstance(error, EngineDead) and "exit code -9" in str(error)
        assert core.dead_reason is not None and "exit code -9" in core.dead_reason
        with pytest.raises(EngineDead):
            getattr(core, command)("after").result(0)
    finally:
        core.stop()
    assert core.process.returncode == -9


@pytest.mark.parametrize("implementation", [ThreadCore, ProcessCore])
def test_each_core_implements_the_interface_with_no_no_op_method_and_no_ignored_argument(implementation: type) -> None:
    """Both cores have the `Core` protocol's members with its signatures; no method of theirs is a no-op (a body
    of only a docstring, `pass` or `return None`) or leaves one of its arguments unread."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(implementation)))
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    attributes = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    for name in [name for name in vars(Core) if not name.startswith("_")]:
        ours, theirs = getattr(Core, name), getattr(implementation, name, None)
        if isinstance(ours, property):  # a property of theirs, or an attribute they set
            assert isinstance(theirs, property) or (theirs is None and name in attributes), name
        else:
            assert inspect.signature(theirs) == inspect.signature(ours), name
    for method in [node for node in cls.body if isinstance(node, ast.FunctionDef)]:
        body = [n for n in method.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        no_op = all(isinstance(n, ast.Pass) or (isinstance(n, ast.Return) and n.value is None) for n in body)
        assert not no_op, f"{implementation.__name__}.{method.name} does nothing"
        read = {n.id for n in ast.walk(method) if isinstance(n, ast.Name)}
        args = method.args
        for arg in [*args.args[1:], *args.kwonlyargs]:
            assert arg.arg in read, f"{implementation.__name__}.{method.name} ignores its argument {arg.arg}"


def test_the_engine_process_freezes_what_start_up_left_so_the_collector_does_not_walk_the_model() -> None:
    """_build, the child's start (run here, in this process): after warm-up the heap is frozen, so no collection in the
    step loop walks the model's objects again (a full one took ~190 ms on the shipped model)."""
    import gc

    from llmserve.engine.core.process import _build

    gc.unfreeze()
    try:
        core = _build(ChildSpec(tiny64, CONFIG))
        assert gc.get_freeze_count() > 10_000  # torch's and the model's objects among them
        assert len(gc.get_objects()) < gc.get_freeze_count() / 10  # what a collection would still walk
        assert core.num_running == 0
    finally:
        gc.unfreeze()
