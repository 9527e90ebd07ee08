"""The asyncio front end of the engine: `generate()` streams a request's deltas; the step loop runs elsewhere.

The core runs on a thread of this process (`EngineCore`) or in an engine process of its own (`CoreClient`,
core_process.py; what `python -m llmserve` does, see `build_engine`); this class drives either the same way. The
step loop hands each pass's token outputs to the event loop in one call; there the output processor
(output_processor.py) turns them into deltas (text, stop strings) and routes each to its stream. Detokenizing
costs the event loop, not the thread that feeds the device, and with an engine process not even its GIL.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmserve.engine.config import EngineConfig
from llmserve.engine.constraints import Compiled, ConstraintCompiler
from llmserve.engine.core import EngineCore
from llmserve.engine.core_process import CoreClient
from llmserve.engine.fanout import Merger, split
from llmserve.engine.kv_events import KvEvent
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.outputs import EngineOutput
from llmserve.engine.protocol import EngineStats, ModelInfo, SessionInfo
from llmserve.engine.request import (
    ConstraintSpec,
    Delta,
    EngineDead,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    QueueFull,
)
from llmserve.models import LoadedModel


class AsyncEngine:
    """Builds the engine (backend included: KV cache, packing, graphs) in its constructor, which can take
    seconds: construct it off the event loop. `start()` warms up and starts the step thread."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, core: CoreClient | None = None) -> None:
        self.loaded = loaded
        self.config = config
        # The core on a thread of this process, or in a child process (`core`: a CoreClient that is ready).
        self.core: EngineCore | CoreClient = EngineCore(loaded, config) if core is None else core
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs = OutputProcessor(loaded.tokenizer)  # used on the event loop only
        self.constraints = ConstraintCompiler.for_model(loaded, config)

    @property
    def tokenizer(self) -> Any:  # a transformers tokenizer, or None for random-weight models
        return self.loaded.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        facts = self.core.facts
        assert facts is not None
        return ModelInfo(
            name=self.loaded.name,
            context_length=facts.max_model_len,
            max_new_tokens=facts.max_model_len - 1,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            device=str(self.loaded.device),
            vocab_size=self.loaded.vocab_size,
            backend=f"{facts.backend_name}: {facts.backend_description}",
            sliding_window=facts.sliding_window or 0,
            eos_token_ids=self.loaded.eos_token_ids,
        )

    @property
    def dead(self) -> bool:
        return self.core.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self.core.dead_reason

    @property
    def engine_pid(self) -> int | None:
        core = self.core
        return core.process.pid if isinstance(core, CoreClient) else None

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    async def start(self) -> None:
        """Warm up (one short generation, off the event loop), then start the step thread."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.core.warm_up)
        self._thread = threading.Thread(
            target=self.core.run, args=(self._stop, self._emit), name="llmserve-engine", daemon=True
        )
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the step thread; requests still running end with CANCELLED."""
        self._stop.set()
        self.core.wake()
        if self.constraints is not None:
            self.constraints.close()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            self.core.drain_inbox()  # a session query that came as the thread ended: answered here

    def stats(self) -> EngineStats:
        return self.core.stats()

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's stored and removed blocks since the last call (kv_events.py), numbered."""
        return self.core.take_kv_events()

    async def get_session(self, session_id: str) -> SessionInfo | None:
        """The cached session's state, asked of the step thread through its inbox (answered within a step)."""
        answer = await self._ask(session_id, delete=False)
        return answer if isinstance(answer, SessionInfo) else None

    async def delete_session(self, session_id: str) -> bool:
        return bool(await self._ask(session_id, delete=True))

    async def _ask(self, session_id: str, *, delete: bool) -> SessionInfo | bool | None:
        reply = self.core.query_session(session_id, delete=delete)
        if self._thread is None:  # no step thread: nothing else touches the books, answer here
            self.core.drain_inbox()
        return await asyncio.wrap_future(reply)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream the request's deltas. Raises InvalidRequest, EngineDead or QueueFull before the first one.

        One delta per step while the consumer keeps up. After the first (its first token, always alone), the
        deltas a consumer has not yet taken come as one: a reader that falls behind (a slow client, or a
        front end at its limit of messages a second) gets fewer, fuller messages instead of a growing queue.
        Closing or cancelling the consumer aborts the request in the engine.

        With `request.n` > 1 the stream carries n completions (fanout.py), each delta tagged with its `index`, each
        completion's deltas as above; it ends once all n have finished, or at the first that fails (ERROR), which
        ends the others.
        """
        if self.dead:
            raise EngineDead(self.dead_reason)
        self.core.validate(request)
        if self.core.num_waiting + request.n > self.config.max_waiting:
            raise QueueFull(f"{self.core.num_waiting} requests waiting")
        compiled = None
        if request.constraint is not None:
            # Before the request is queued, on a worker thread: a slow compile delays this caller only. Compiled
            # once; each completion gets its own state.
            compiled = await self._compile(request.constraint)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        handles: list[int] = []
        for index, single in enumerate(split(request)):
            state = None if compiled is None else compiled.start()
            handle = self.core.submit(single, state, after=handles[0] if handles else None)
            self._outputs.add(handle, single, deltas.put_nowait, index)  # before any output can reach the loop
            handles.append(handle)
        merger = Merger(len(handles))
        try:
            while merger.open:
                batch = [await deltas.get()]  # a completion's first token goes out alone, as soon as it exists
                while not deltas.empty():
                    batch.append(deltas.get_nowait())
                for delta in merger.take(batch):
                    yield delta
                    if delta.finish_reason is FinishReason.ERROR and len(handles) > 1:
                        return  # one completion failed: the call ends, and the others with it
        finally:
            for index in merger.open:
                self._outputs.discard(handles[index])
                self.core.abort(handles[index])

    async def _compile(self, spec: ConstraintSpec) -> Compiled:
        if self.constraints is None:
            raise InvalidRequest(spec.field, "the model has no tokenizer: constraints need one")
        return await self.constraints.compile(spec)

    def _emit(self, outputs: list[EngineOutput]) -> None:
        """On the step thread: hand one pass's outputs to the event loop, in one call (a call_soon_threadsafe per
        delta cost the step thread ~1 ms at 256 sequences, one per step ~0.03 ms)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        """On the event loop: deltas to their streams; requests a stop string ended are stopped in the core."""
        for handle, keep_generated in self._outputs.process(outputs):
            self.core.abort(handle, keep_generated)


async def build_engine(
    load: Callable[[], LoadedModel], config: EngineConfig, client: CoreClient | None = None
) -> AsyncEngine:
    """The engine over the model `load` builds: with `client` (started already), the core in its engine process,
    which loads the model itself (`load` is then not called here); else on a thread of this process. Building takes
    seconds (loading, KV allocation, weight packing, graph capture): it runs off the event loop. Cancelling it
    kills the engine process."""
    if client is None:
        return await asyncio.to_thread(AsyncEngine, await asyncio.to_thread(load), config)
    try:
        await asyncio.to_thread(client.wait_ready)
    except asyncio.CancelledError:
        client.kill()
        raise
    assert client.loaded is not None
    return AsyncEngine(client.loaded, config, core=client)
