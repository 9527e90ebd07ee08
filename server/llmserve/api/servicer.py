"""The GenerateService servicer: protobuf in, engine request out; engine deltas in, protobuf out.

It knows nothing of blocks or batches. One Generate call, in order: admit the stream (admission.py), check
the sizes the caller sent (limits.py), build the prompt (prompts.py; through the session history store when
the call names a session), convert it to the engine's request (convert.py), stream the engine's deltas back
as messages, and close the call's one record (telemetry/call.py), from which the request log line, the
metrics and the trace are made. Errors are raised as exceptions; the interceptor in app.py turns them into
gRPC statuses (errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import grpc

from llmserve.api.admission import Admission, StreamKey, scoped
from llmserve.api.convert import (
    POOLING_NAMES,
    input_text,
    to_embedding,
    to_generation_request,
    to_pooling_params,
    to_pooling_request,
    to_response,
)
from llmserve.api.errors import ServiceError, StreamStalled, code_name
from llmserve.api.limits import (
    check_classify,
    check_embed,
    check_generate,
    check_input,
    cut_utf8,
    is_valid_id,
    prompt_byte_limit,
    quote_prefix,
    truncation_byte_bound,
)
from llmserve.api.prompts import (
    SessionPrompts,
    embed_prompt,
    embed_texts,
    embed_token_ids,
    prompt_token_ids,
    special_tokens,
)
from llmserve.api.rerank import check_rerank, pair_limit, pair_request, rerank_pairs, rerank_results
from llmserve.auth import caller_identity
from llmserve.config import ServerConfig
from llmserve.engine.types.errors import EngineDead, InvalidRequest, QueueFull
from llmserve.engine.types.outputs import Delta, FinishReason
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import GenerationRequest, PoolingParams
from llmserve.history import HistoryInput, HistoryStore, Turn, open_store
from llmserve.telemetry.call import CallObserver, CallRecord
from llmserve.telemetry.request_log import log_call
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

if TYPE_CHECKING:
    from llmserve.engine.types.protocol import Engine, ModelInfo

log = logging.getLogger("llmserve.requests")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name
_TASKS = {"generate": pb.TASK_GENERATE, "embed": pb.TASK_EMBED, "classify": pb.TASK_CLASSIFY}
# Calls a model serves beside its engine's tasks: a classifier also scores (query, document) pairs (api/rerank.py).
_EDGE_TASKS = {"classify": (pb.TASK_RERANK,)}
_HISTORY_INPUT = {HistoryInput.CHAT: pb.HISTORY_INPUT_CHAT, HistoryInput.TOKENS: pb.HISTORY_INPUT_TOKENS}
# The engine stops a request this long before the call's deadline, so that the server, not the caller's
# timer, ends the call (with a last message); a cancel this close to the deadline is the deadline's (the
# caller's own timer fired first).
DEADLINE_MARGIN_S = 0.1
# How an ending that is not a normal finish ends the call, after its last message has been sent.
_ENDINGS = {
    FinishReason.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"),
    FinishReason.CANCELLED: (grpc.StatusCode.UNAVAILABLE, "the server cancelled the request (shutdown)"),
}


@dataclass(slots=True, eq=False)
class Call:
    """One Generate call as an edge sees it while `GenerateServicer.serve` runs it: its record, its admission key
    and its engine request once they exist."""

    request_id: str
    record: CallRecord = field(init=False)
    key: StreamKey | None = None
    engine_request: GenerationRequest | None = None
    has_session: bool = False
    first: bool = True  # no delta sent yet

    def __post_init__(self) -> None:
        self.record = CallRecord(self.request_id or "-", time.monotonic())


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Serves llmserve.v1.GenerateService; answers UNAVAILABLE until `attach()` hands it a started engine."""

    def __init__(
        self,
        config: ServerConfig,
        observers: Sequence[CallObserver] = (),
        histories: HistoryStore | None = None,
        admission: Admission | None = None,
    ) -> None:
        """`observers` are told about each Generate call once it ends (metrics, tracing); `histories` is the
        session history store (default: the one config.history names), which the server connects at start and
        closes at stop; `admission` counts the streams in flight (default: one with the config's caps)."""
        self._config = config
        self._observers = tuple(observers)
        self._engine: Engine | None = None
        self._limits = config.limits
        self._max_prompt_bytes = 0
        if admission is None:
            admission = Admission.of(config)
        self.admission = admission
        self.histories: HistoryStore = histories if histories is not None else open_store(config.history)
        self.prompts = SessionPrompts(self.histories, config.history.max_tokens)

    def attach(self, engine: Engine) -> None:
        """Start serving with `engine` (already started and warmed up): the limits that depend on its model
        (the prompt's bytes, the per-session token cap when --max-session-tokens is unset) from now on."""
        info = engine.model_info
        self._max_prompt_bytes = prompt_byte_limit(self._limits, info.context_length)
        cap = self._config.history.max_tokens
        self.prompts = SessionPrompts(self.histories, info.context_length if cap is None else cap)
        self._engine = engine

    def begin_drain(self) -> None:
        """Refuse new Generate streams from now on; those in flight go on."""
        self.admission.draining = True

    @property
    def num_streams(self) -> int:
        """Generate streams in flight."""
        return len(self.admission)

    async def wait_idle(self) -> None:
        """Return once no Generate stream is in flight."""
        await self.admission.wait_idle()

    @property
    def engine(self) -> Engine | None:
        """The engine served, once attached."""
        return self._engine

    def ready_engine(self) -> Engine:
        """The engine served; UNAVAILABLE until it is attached."""
        if self._engine is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self._engine

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = Call(request.request_id)
        options = request.response
        async with contextlib.aclosing(self.serve(call, lambda: request, context)) as deltas:
            async for delta in deltas:
                assert call.engine_request is not None  # built before the engine's first delta
                prompt_ids = call.engine_request.prompt_token_ids if options.prompt_token_ids and call.first else ()
                call.first = False
                try:
                    yield to_response(call.record.request_id, delta, options, prompt_ids)
                except Exception as exc:  # thrown in at the yield (a stalled reader): the call's record must see it
                    await deltas.athrow(exc)
                    raise

    async def serve(
        self,
        call: Call,
        build: Callable[[], pb.GenerateRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncGenerator[Delta, None]:
        """One Generate call of either edge, from the request `build` returns (called inside the call's record,
        so that a request its edge refuses to translate is recorded too) to its deltas: admission, limits, the
        prompt, the engine request, the stream and the call's one record. Raises what the interceptor maps."""
        identity = caller_identity()
        record = call.record
        record.identity = identity
        remaining = context.time_remaining()
        call_deadline = None if remaining is None else time.monotonic() + remaining
        key: StreamKey | None = None
        turn: Turn | None = None
        try:
            engine = self.ready_engine()
            if "generate" not in engine.model_info.tasks:
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"model {engine.model_info.name} does not generate: it is an embedding model or a classifier, "
                    "call Embed",
                )
            request = build()
            call.has_session = bool(request.session_id)
            check_generate(request, self._limits, self._max_prompt_bytes)
            request_id = record.request_id = request.request_id or uuid.uuid4().hex
            key = call.key = await self.admission.admit(identity, request_id)
            # The history store is keyed per identity too: the request id it names is the caller's own.
            session_key = scoped(identity, request.session_id) if request.session_id else None
            prompt_ids, turn = await self.prompts.prompt(engine.tokenizer, request, request_id, session_key)
            gen_request = call.engine_request = self._engine_request(
                engine, request, request_id, prompt_ids, session_key, call_deadline, identity
            )
            record.prompt_tokens = len(gen_request.prompt_token_ids)
            if self._config.log_prompts:
                record.prompt = input_text(request)
            record.queued = time.monotonic()
            # aclosing: however this call ends, the engine request is aborted before the log line is written.
            async with contextlib.aclosing(self._stream(engine, gen_request, record, turn)) as deltas:
                async for delta in deltas:
                    yield delta
            record.status = "OK"
        except (asyncio.CancelledError, GeneratorExit):
            # A caller that goes away cancels the handler, or, when gRPC notices it at a write, closes this
            # generator (GeneratorExit); both are the caller's cancel, or its deadline: the caller's own
            # timer fires just before ours would.
            at_deadline = call_deadline is not None and time.monotonic() >= call_deadline - DEADLINE_MARGIN_S
            record.status = "DEADLINE_EXCEEDED" if at_deadline else "CANCELLED"
            if record.queued is not None:
                record.finish_reason = "deadline" if at_deadline else "cancelled"
            raise
        except Exception as exc:
            record.status = code_name(exc)
            if isinstance(exc, (InvalidRequest, QueueFull, EngineDead)):
                record.queued = None  # the engine refused it before taking it
            elif isinstance(exc, StreamStalled):
                record.finish_reason = "cancelled"
            raise
        finally:
            if turn is not None:
                await turn.release()
            if key is not None:
                self.admission.release(key)
            self._record_end(record, call.has_session, context)

    def _engine_request(
        self,
        engine: Engine,
        request: pb.GenerateRequest,
        request_id: str,
        prompt_ids: Sequence[int],
        session_key: str | None,
        call_deadline: float | None,
        identity: str | None,
    ) -> GenerationRequest:
        """The engine's request for this call: the caller's, with the call's deadline and identity applied."""
        return to_generation_request(
            request,
            prompt_ids,
            request_id=scoped(identity, request_id),  # request ids are unique per identity, not across them
            info=engine.model_info,
            default_max_new_tokens=self._config.default_max_new_tokens,
            session_key=session_key,
            deadline=None if call_deadline is None else call_deadline - DEADLINE_MARGIN_S,
            cache_salt=self.cache_salt(identity),
        )

    def cache_salt(self, identity: str | None) -> str | None:
        """The prefix cache's salt for `identity`'s prompts: with authentication on, a caller's prompts share cached
        blocks only with its own (unless --shared-prefix-cache)."""
        return None if identity is None or self._config.shared_prefix_cache else identity

    def _record_end(self, record: CallRecord, has_session: bool, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Close the call's record once; the log line, the metrics and the trace are all made from it."""
        record.close(has_session=has_session, metadata=context.invocation_metadata())
        log_call(record)
        for observer in self._observers:
            try:
                observer.call_finished(record)
            except Exception:  # an observer's bug must not fail the call or the others
                log.exception("call observer %r failed", observer)

    async def _stream(
        self, engine: Engine, gen_request: GenerationRequest, record: CallRecord, turn: Turn | None = None
    ) -> AsyncGenerator[Delta, None]:
        """Yield the engine's deltas, each recorded; raise for endings that are not a normal finish (after their
        delta was sent)."""
        # aclosing: a cancel while we wait on the client still closes (and so aborts) the engine request.
        async with contextlib.aclosing(cast(AsyncGenerator[Delta, None], engine.generate(gen_request))) as deltas:
            async for delta in deltas:
                record.observe(delta)
                if turn is not None and delta.finish_reason is not FinishReason.DEADLINE:
                    await turn.observe(delta)  # commits the history before the caller sees the last message
                yield delta
                if delta.finish_reason is FinishReason.ERROR:
                    raise ServiceError(grpc.StatusCode.INTERNAL, f"generation failed: {delta.error}")
                if delta.finish_reason in _ENDINGS:
                    raise ServiceError(*_ENDINGS[delta.finish_reason])

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.EmbedResponse:
        """One vector per input: every input checked and tokenized first (a bad one fails the call before any
        reaches the engine), then each a pooling request of its own in the engine's batches, all at once."""
        async with self._pooling_call("Embed", request.request_id, context) as (call, call_deadline):
            record, identity = call.record, call.record.identity
            engine = self.ready_engine()
            info = engine.model_info
            classify = "classify" in info.tasks
            if "embed" not in info.tasks and not classify:
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"model {info.name} serves no Embed: it has no pooling configured (a generative model needs "
                    "--pooling; GetModelInfo's tasks say what it serves)",
                )
            if classify:
                check_classify(request)
            check_embed(request, self._limits, self._max_prompt_bytes, info.embedding_size)
            prompt = embed_prompt(request, info.prompts, info.default_prompt_name, info.serves_prompts)
            request_id = record.request_id = request.request_id or uuid.uuid4().hex
            record.inputs = len(request.inputs)
            call.key = await self.admission.admit_pooling(identity, request_id, len(request.inputs))
            prompts = await asyncio.to_thread(embed_prompts, engine.tokenizer, request, info, prompt)
            pooling = to_pooling_params(request, info)
            scoped_id = scoped(identity, request_id)
            engine_requests = [
                to_pooling_request(request, i, ids, request_id=scoped_id, pooling=pooling, deadline=call_deadline)
                for i, (ids, _) in enumerate(prompts)
            ]
            record.queued = time.monotonic()
            finals = await _pool_all(engine, engine_requests)
            response = pb.EmbedResponse(request_id=request_id, labels=info.labels)
            for i, ((_, truncated), delta) in enumerate(zip(prompts, finals, strict=True)):
                response.embeddings.append(to_embedding(i, delta, truncated, classify=classify))
                if delta.usage is not None:
                    record.prompt_tokens += delta.usage.prompt_tokens
                    record.cached_prompt_tokens += delta.usage.cached_prompt_tokens
            response.usage.prompt_tokens = record.prompt_tokens
            response.usage.cached_prompt_tokens = record.cached_prompt_tokens
            return response

    async def Rerank(self, request: pb.RerankRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.RerankResponse:
        """One score per document: the call checked and its pairs tokenized first (rerank.py), then each pair a
        pooling request of its own in the engine's batches, all at once, admitted as an Embed call is."""
        async with self._pooling_call("Rerank", request.request_id, context) as (call, call_deadline):
            record, identity = call.record, call.record.identity
            engine = self.ready_engine()
            info = engine.model_info
            if "classify" not in info.tasks or engine.tokenizer is None:
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"model {info.name} serves no Rerank: it is no sequence classifier with a tokenizer (a "
                    "cross-encoder); GetModelInfo's tasks say what it serves",
                )
            check_rerank(request, self._limits, self._max_prompt_bytes)
            request_id = record.request_id = request.request_id or uuid.uuid4().hex
            record.inputs = len(request.documents)
            # Admitted as Embed is: each pair is an engine request, so the call counts by its documents, whole or
            # refused whole (--max-pooling-inputs), and takes no Generate stream slot.
            call.key = await self.admission.admit_pooling(identity, request_id, len(request.documents))
            limit = pair_limit(engine.tokenizer, info.max_embed_input_tokens)
            pairs = await asyncio.to_thread(
                rerank_pairs, engine.tokenizer, request.query, request.documents, limit, info.do_lower_case
            )
            # A classifier's head fixes its pooling: the model's defaults, as an Embed call without options.
            pooling = PoolingParams(PoolingMode(info.pooling), info.normalize, None)
            scoped_id = scoped(identity, request_id)
            engine_requests = [
                pair_request(request, i, pair, request_id=scoped_id, pooling=pooling, deadline=call_deadline)
                for i, pair in enumerate(pairs)
            ]
            record.queued = time.monotonic()
            finals = await _pool_all(engine, engine_requests)
            tokens = [0 if delta.usage is None else delta.usage.prompt_tokens for delta in finals]
            results = rerank_results(request, pairs, [delta.embedding or [] for delta in finals], tokens)
            record.prompt_tokens = sum(tokens)
            response = pb.RerankResponse(request_id=request_id, results=results, labels=info.labels)
            response.usage.prompt_tokens = record.prompt_tokens
            return response

    @contextlib.asynccontextmanager
    async def _pooling_call(
        self, method: str, request_id: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[tuple[Call, float | None]]:
        """The frame of one Embed or Rerank call: its record opened (with the deadline by which the engine must
        end its requests), its status set however the body ends, its admission released and its record closed."""
        call = Call(request_id)
        record = call.record
        record.method = method
        record.identity = caller_identity()
        remaining = context.time_remaining()
        call_deadline = None if remaining is None else time.monotonic() + remaining - DEADLINE_MARGIN_S
        try:
            yield call, call_deadline
            record.finish_reason = "length"
            record.status = "OK"
        except asyncio.CancelledError:
            at_deadline = call_deadline is not None and time.monotonic() >= call_deadline
            record.status = "DEADLINE_EXCEEDED" if at_deadline else "CANCELLED"
            raise
        except Exception as exc:
            record.status = code_name(exc)
            if isinstance(exc, (InvalidRequest, QueueFull, EngineDead)):
                record.queued = None  # the engine refused it before taking it
            raise
        finally:
            if call.key is not None:
                self.admission.release(call.key)
            self._record_end(record, False, context)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.TokenizeResponse:
        tokenizer = self.ready_engine().tokenizer
        check_input(request, self._limits, self._max_prompt_bytes)
        ids = await prompt_token_ids(tokenizer, request)
        tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else []  # token_ids sent: no text
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        engine = self.ready_engine()
        info, adapters = engine.model_info, engine.adapters
        return pb.GetModelInfoResponse(
            name=info.name,
            context_length=info.context_length,
            max_new_tokens=info.max_new_tokens,
            dtype=info.dtype,
            device=info.device,
            vocab_size=info.vocab_size,
            default_max_new_tokens=self._config.default_max_new_tokens,
            backend=info.backend,
            sliding_window=info.sliding_window,
            adapters=[] if adapters is None else sorted(adapters.names),
            max_loras=info.max_loras,
            max_lora_rank=info.max_lora_rank,
            tasks=[t for task in info.tasks for t in (_TASKS[task], *_EDGE_TASKS.get(task, ()))],
            embedding_size=info.embedding_size,
            pooling=POOLING_NAMES.get(info.pooling, pb.POOLING_UNSPECIFIED),
            normalize=info.normalize,
            max_embed_input_tokens=info.max_embed_input_tokens,
            max_embed_inputs=self._limits.max_embed_inputs if info.embedding_size else 0,
            labels=info.labels,
            prompt_names=[name for name, _ in info.prompts],
            default_prompt_name=info.default_prompt_name,
        )

    async def GetSession(
        self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetSessionResponse:
        engine = self.ready_engine()
        key = self._session_key(request.session_id)
        info = held = None
        # An id no Generate call could have used names no session: the same NOT_FOUND as any unknown id.
        if key is not None:
            info = await engine.get_session(key)
            held = await self.histories.get(key)
        if info is None and held is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"no session {quote_prefix(request.session_id)}")
        response = pb.GetSessionResponse(session_id=request.session_id)
        used = 0.0
        if info is not None:
            response.cached_tokens = info.cached_tokens
            response.tier_cached_tokens = info.tier_tokens
            used = info.last_used
        if held is not None:
            response.history_turns = held.turns
            response.history_tokens = len(held.token_ids)
            response.history_input = _HISTORY_INPUT[held.kind]
            used = max(used, held.last_used_wall)
        response.last_used.FromNanoseconds(int(used * 1e9))
        return response

    def _session_key(self, session_id: str) -> str | None:
        """The key of the caller's session `session_id` (GetSession, DeleteSession); None for an id no Generate call
        could have used. An empty id is refused naming `session_id`."""
        if not session_id:
            raise InvalidRequest("session_id", "must not be empty")
        if not is_valid_id(session_id, self._limits.max_session_id_length):
            return None
        # With authentication on, two identities' equal session ids are two sessions, and neither can read,
        # continue or delete the other's.
        return scoped(caller_identity(), session_id)

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteSessionResponse:
        engine = self.ready_engine()
        key = self._session_key(request.session_id)
        if key is None:
            return pb.DeleteSessionResponse(deleted=False)
        held = await self.histories.delete(key)
        cached = await engine.delete_session(key)
        return pb.DeleteSessionResponse(deleted=held or cached)


def embed_prompts(
    tokenizer: Any, request: pb.EmbedRequest, info: ModelInfo, prompt: str = ""
) -> list[tuple[list[int], bool]]:
    """Every input's token ids and whether truncation cut it (on a worker thread: it tokenizes), each text after the
    instruction `prompt` (embed_prompt); InvalidRequest naming the first input that is too long or holds ids outside
    the vocabulary."""
    prompts = []
    specials = ([], []) if tokenizer is None else special_tokens(tokenizer)
    limit = info.max_embed_input_tokens
    # A batch's texts through the tokenizer in one call: one Python wrapper and one Rust batch for the call, not
    # one per input.
    texts = [i for i, item in enumerate(request.inputs) if item.WhichOneof("input") == "text"]
    contents: dict[int, list[int]] = {}
    byte_cut: set[int] = set()
    if texts and tokenizer is not None:
        batch = [prompt + request.inputs[i].text for i in texts]  # the prompt counts in the limit, as the text
        if request.truncate != pb.TRUNCATION_UNSPECIFIED:
            # What truncation keeps lies within the text's first (or last) bytes: the rest is never tokenized.
            bound, keep_end = truncation_byte_bound(limit), request.truncate == pb.TRUNCATION_KEEP_END
            for j, i in enumerate(texts):
                batch[j], was_cut = cut_utf8(batch[j], bound, keep_end)
                if was_cut:
                    byte_cut.add(i)
        encoded = embed_texts(tokenizer, batch, info.do_lower_case)
        contents = dict(zip(texts, encoded, strict=True))
    for i, item in enumerate(request.inputs):
        field = f"inputs[{i}]"
        ids, cut = embed_token_ids(
            tokenizer, item, field, limit, request.truncate, info.do_lower_case, specials, contents.get(i), prompt
        )
        if any(t < 0 or t >= info.vocab_size for t in ids):
            raise InvalidRequest(f"{field}.token_ids.ids", f"ids must be in [0, {info.vocab_size})")
        prompts.append((ids, cut or i in byte_cut))
    return prompts


async def _pool_all(engine: Engine, requests: Sequence[GenerationRequest]) -> list[Delta]:
    """Each pooling request's final delta, all in the engine at once; the first failure ends the others."""
    tasks = [asyncio.ensure_future(_pool_one(engine, request)) for request in requests]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a failed or cancelled call: the other inputs' requests are aborted in the engine


async def _pool_one(engine: Engine, request: GenerationRequest) -> Delta:
    async with contextlib.aclosing(cast(AsyncGenerator[Delta, None], engine.generate(request))) as deltas:
        async for delta in deltas:
            if delta.finish_reason is FinishReason.ERROR:
                raise ServiceError(grpc.StatusCode.INTERNAL, f"embedding failed: {delta.error}")
            if delta.finish_reason in _ENDINGS:
                raise ServiceError(*_ENDINGS[delta.finish_reason])
            if delta.finished:
                return delta
    raise ServiceError(grpc.StatusCode.INTERNAL, "the engine ended a pooling request without its vector")
