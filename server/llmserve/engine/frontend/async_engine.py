"""The asyncio front end of the engine: `generate()` streams a request's deltas; the step loop runs elsewhere.

The front end holds one `Core` (core/client.py): the core on a thread of this process (core/engine_core.ThreadCore, the
default here) or in an engine process of its own (core/process.ProcessCore, what `python -m llmserve` runs: see
`build_engine`). It checks a request (its values against the core's facts, its constraint with the checker,
constraints.py) before anything is queued, adds it, and turns the core's outputs into the caller's deltas: the core
hands each pass's token outputs to the event loop in one call, where the output processor (output_processor.py)
detokenizes, applies stop strings and routes each delta to its stream. Detokenizing costs the event loop, not the
thread that feeds the device, and with an engine process not even its GIL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, cast

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.client import Core
from llmserve.engine.core.process import ProcessCore
from llmserve.engine.frontend.detokenizer import Decoder
from llmserve.engine.frontend.fanout import split
from llmserve.engine.frontend.output_processor import OutputProcessor
from llmserve.engine.sample.constraints import ConstraintChecker, Vocabulary
from llmserve.engine.types.adapters import AdapterAnswer, AdapterOp, UnknownAdapter
from llmserve.engine.types.errors import EngineDead, InvalidRequest, QueueFull
from llmserve.engine.types.kv_cache import KvEvent
from llmserve.engine.types.model import ModelCard
from llmserve.engine.types.outputs import Delta, EngineOutput, FinishReason, Usage
from llmserve.engine.types.protocol import EngineStats, ModelInfo, SessionInfo
from llmserve.engine.types.request import ConstraintSpec, GenerationRequest, validate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llmserve.engine.types.model import LoadedModel  # the torch side: imported only where a core runs here


class AsyncEngine:
    """The engine over `core`, or by default over a core on a thread of this process, built here (KV cache, packing,
    graphs: seconds; construct it off the event loop). `start()` starts the core."""

    def __init__(self, loaded: LoadedModel | ModelCard, config: EngineConfig, core: Core | None = None) -> None:
        """`loaded`: the model, for a core built here; with `core`, its card is enough (an engine process's)."""
        self.loaded = loaded
        self.card = loaded if isinstance(loaded, ModelCard) else loaded.card()
        self.config = config
        vocabulary = Vocabulary.for_model(self.card)  # one per process: a core built here shares it
        if core is None:
            if isinstance(loaded, ModelCard):
                raise TypeError("a core built here needs the LoadedModel, not its card")
            # The torch side: only where the core runs here (a LoadedModel, so torch is loaded already).
            from llmserve.engine.core.engine_core import EngineCore, ThreadCore

            core = ThreadCore(EngineCore(loaded, config, vocabulary))
        self.core: Core = core
        self.checker = None if vocabulary is None else ConstraintChecker.over(vocabulary, config)
        # Used on the event loop only. A transformers tokenizer decodes a list of ids to one str (its stubs say
        # str | list[str], for batches).
        self._processor = OutputProcessor(cast("Decoder | None", self.card.tokenizer))
        self._loop: asyncio.AbstractEventLoop | None = None
        # The LoRA adapters as the core last answered (at start, then after each AdapterService call): what a
        # request's adapter is checked against before it is queued. None when the core serves none.
        self.adapters: AdapterAnswer | None = self.core.facts.lora

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.card.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        facts = self.core.facts
        pooling, classifier = self.card.pooling, self.card.classifier
        if classifier is not None:
            pooled: tuple[str, ...] = ("classify",)
            embedding_size = len(classifier.labels)
        else:
            pooled = ("embed",) * facts.pools
            embedding_size = 0 if pooling is None else pooling.embedding_size
        return ModelInfo(
            name=self.card.name,
            context_length=facts.max_model_len,
            max_new_tokens=facts.max_model_len - 1,
            dtype=self.card.dtype,
            device=self.card.device,
            vocab_size=self.card.vocab_size,
            backend=f"{facts.backend_name}: {facts.backend_description}",
            sliding_window=facts.sliding_window or 0,
            eos_token_ids=self.card.eos_token_ids,
            max_loras=0 if facts.lora is None else facts.lora.limits.max_loras,
            max_lora_rank=0 if facts.lora is None else facts.lora.limits.max_lora_rank,
            tasks=("generate",) * facts.generates + pooled,
            embedding_size=embedding_size,
            pooling="" if pooling is None else pooling.mode.value,
            normalize=pooling is not None and pooling.normalize,
            max_embed_input_tokens=facts.max_pooling_tokens,
            do_lower_case=pooling is not None and pooling.do_lower_case,
            labels=() if classifier is None else classifier.labels,
            prompts=() if pooling is None else pooling.prompts,
            default_prompt_name="" if pooling is None else pooling.default_prompt_name,
            serves_prompts=pooling is None or pooling.include_prompt,
        )

    @property
    def dead(self) -> bool:
        return self.core.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self.core.dead_reason

    @property
    def engine_pid(self) -> int | None:
        return self.core.pid

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    async def start(self) -> None:
        """Start the core (a core on a thread warms up first), off the event loop."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.core.start, self._emit)

    async def shutdown(self) -> None:
        """Stop the core; requests still running end with CANCELLED, session queries are answered or fail."""
        if self.checker is not None:
            self.checker.close()
        await asyncio.to_thread(self.core.stop)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's stored and removed blocks since the last call (kv_events.py), numbered."""
        return self.core.take_kv_events()

    async def get_session(self, session_id: str) -> SessionInfo | None:
        """The cached session's state, asked of the core (answered within a step); EngineDead once it has ended."""
        return await asyncio.wrap_future(self.core.get_session(session_id))

    async def delete_session(self, session_id: str) -> bool:
        return await asyncio.wrap_future(self.core.delete_session(session_id))

    async def manage_adapters(self, op: AdapterOp) -> AdapterAnswer:
        """An AdapterService call, answered by the core (a load once its files are read, off the step thread)."""
        answer = await asyncio.wrap_future(self.core.manage_adapters(op))
        self.adapters = answer
        return answer

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
        validate(request, self.core.facts)
        if request.adapter is not None and (self.adapters is None or request.adapter not in self.adapters.names):
            raise UnknownAdapter(request.adapter)
        waiting = self.core.num_waiting
        if waiting + request.n > self.config.max_waiting:
            raise QueueFull(f"{waiting} requests waiting")
        if request.constraint is not None:
            # Before the request is queued, on a worker thread: a slow check delays this caller only. The engine
            # compiles it (once per distinct spec) and gives each completion its own grammar state.
            await self._check(request.constraint)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        handles: list[int] = []
        try:
            for index, single in enumerate([request] if request.n == 1 else split(request)):
                handle = self.core.add(single, after=handles[0] if handles else None)
                self._processor.add(handle, single, deltas.put_nowait, index)  # before any output reaches the loop
                handles.append(handle)
        except EngineDead:  # the core stopped between two completions: the ones added go too
            self._forget(handles)
            raise
        merger = DeltaStream(len(handles))
        held: list[Delta] = []  # what arrived with a completion's first token, joined with what comes by the next read
        try:
            while merger.open:
                batch = held or [await deltas.get()]  # a completion's first token goes out alone, as soon as it exists
                while not deltas.empty():
                    batch.append(deltas.get_nowait())
                out, held = merger.take(batch)
                for delta in out:
                    yield delta
                    if delta.finish_reason is FinishReason.ERROR and len(handles) > 1:
                        return  # one completion failed: the call ends, and the others with it
        finally:
            self._forget([handles[index] for index in merger.open])

    async def _check(self, spec: ConstraintSpec) -> None:
        if self.checker is None:
            raise InvalidRequest(spec.field, "the model has no tokenizer: constraints need one")
        await self.checker.check(spec)

    def _forget(self, handles: list[int]) -> None:
        """The caller went away: its open completions are no longer routed, and the core stops them."""
        for handle in handles:
            self._processor.discard(handle)
            self.core.abort(handle)

    def _emit(self, outputs: list[EngineOutput]) -> None:
        """On the core's thread: hand one pass's outputs to the event loop, in one call (a call_soon_threadsafe per
        delta cost the step thread ~1 ms at 256 sequences, one per step ~0.03 ms)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        """On the event loop: deltas to their streams; requests a stop string ended are stopped in the core."""
        for handle, keep_generated in self._processor.process(outputs):
            self.core.abort(handle, keep_generated)


class DeltaStream:
    """Turns the deltas of a call's completions (n of them, 1 unless it asked for more), in the order they arrived,
    into the stream a caller reads.

    Per completion (`Delta.index`) the order is kept and the deltas that arrived together are joined into one
    (Delta.then), except its first delta, which goes alone, as the first token always does. Completions interleave
    in arrival order. When n > 1, the delta that finishes the last completion carries `total_usage`: prompt and
    cached prompt tokens as completion 0 counted them (the prompt once), completion tokens summed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.open = set(range(n))  # completions whose final delta has not been taken yet
        self._started: set[int] = set()
        self._total = Usage(0, 0, 0)

    def take(self, batch: list[Delta]) -> tuple[list[Delta], list[Delta]]:
        """The deltas to yield for those that arrived since the last call, and the rest of `batch`, to pass in again
        with what arrives meanwhile: from the first delta that follows its completion's first one in this batch
        (that first goes alone; what came with it joins whatever else has arrived by the caller's next read, as
        a consumer that fell behind gets all it has not taken in one delta)."""
        out: list[Delta] = []
        joinable: dict[int, int] = {}  # completion -> where in `out` its delta is that later ones join
        fresh: set[int] = set()  # completions whose first delta is in `out`
        for at_batch, delta in enumerate(batch):
            index = delta.index
            if index in fresh:
                rest = batch[at_batch:]
                break
            at = joinable.get(index)
            if at is not None:
                out[at] = out[at].then(delta)
                continue
            if index in self._started:
                joinable[index] = len(out)
            else:
                fresh.add(index)
            self._started.add(index)
            out.append(delta)
        else:
            rest = []
        for delta in out:
            if delta.finished:
                self._finish(delta)
        return out, rest

    def _finish(self, delta: Delta) -> None:
        self.open.discard(delta.index)
        total, usage = self._total, delta.usage
        if usage is not None:
            if delta.index == 0:
                total.prompt_tokens, total.cached_prompt_tokens = usage.prompt_tokens, usage.cached_prompt_tokens
            total.completion_tokens += usage.completion_tokens
        if not self.open and self.n > 1:
            delta.total_usage = Usage(total.prompt_tokens, total.cached_prompt_tokens, total.completion_tokens)


async def build_engine(
    load: Callable[[], LoadedModel], config: EngineConfig, core: ProcessCore | None = None
) -> AsyncEngine:
    """The engine over the model `load` builds: with `core` (an engine process started already,
    core/process.ProcessCore), over that core once it is ready, which loads the model itself (`load` is then not
    called here); else over a core on a thread of this process. Building takes seconds (loading, KV allocation,
    weight packing, graph capture): it runs off the event loop. Cancelling it kills the engine process."""
    if core is None:
        return await asyncio.to_thread(AsyncEngine, await asyncio.to_thread(load), config)
    try:
        await asyncio.to_thread(core.wait_ready)
    except asyncio.CancelledError:
        core.kill()
        raise
    assert core.card is not None
    return AsyncEngine(core.card, config, core=core)
