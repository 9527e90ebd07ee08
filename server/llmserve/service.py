"""The GenerateService servicer: protobuf in, engine request out; engine deltas in, protobuf out.

It knows nothing of blocks or batches. Its own work is what only the edge can do: bound and tokenize the
input, fill in server defaults, admit or refuse a stream, scope request and session ids to the caller's
identity, tie the call's deadline and cancellation to the engine request, and log one line per request.
Errors are raised as exceptions (`InvalidRequest`, `QueueFull`, `EngineDead`, `ServiceError`); the
interceptor in app.py turns them into gRPC statuses with `status_for`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from llmserve.auth import caller_identity
from llmserve.config import ServerConfig
from llmserve.engine.request import (
    ConstraintKind,
    ConstraintSpec,
    Delta,
    EngineDead,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    QueueFull,
    SamplingParams,
    StoppingParams,
    TokenLogprob,
)
from llmserve.history import (
    HistoryBusy,
    HistoryInput,
    HistoryStore,
    LeaseLost,
    NoHistory,
    StoreUnavailable,
    Turn,
    open_store,
)
from llmserve.limits import check_generate, check_input, is_valid_id, prompt_byte_limit, quote_prefix
from llmserve.telemetry.call import CallObserver, CallRecord
from llmserve.telemetry.request_log import MAX_LOGGED_PROMPT_CHARS, clip, log_call
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

if TYPE_CHECKING:
    from llmserve.engine.protocol import Engine

log = logging.getLogger("llmserve.requests")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name

# Engine field names -> the request field a caller sees (the input field is filled in per request).
_FIELD_PATHS = {
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "logit_bias": "sampling.logit_bias",
    "seed": "sampling.seed",
    "max_new_tokens": "stopping.max_new_tokens",
    "min_new_tokens": "stopping.min_new_tokens",
    "stop_sequences": "stopping.stop_sequences",
    "stop_token_ids": "stopping.stop_token_ids",
    "top_logprobs": "response.top_logprobs",
    "prompt_token_ids": "token_ids.ids",
}


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
# How long a call whose request_id is still in flight waits for that stream to end (it may have just been
# cancelled) before the id counts as a duplicate.
REUSE_WAIT_S = 0.5
_HISTORY_INPUT = {HistoryInput.CHAT: pb.HISTORY_INPUT_CHAT, HistoryInput.TOKENS: pb.HISTORY_INPUT_TOKENS}
# The engine stops a request this long before the call's deadline, so that the server, not the caller's
# timer, ends the call (with a last message); a cancel this close to the deadline is the deadline's (the
# caller's own timer fired first).
DEADLINE_MARGIN_S = 0.1
# RESOURCE_EXHAUSTED answers carry google.rpc.RetryInfo with this delay: streams last seconds, not minutes.
RETRY_DELAY_S = 1.0
# Status messages are cut to this many characters (a backstop: messages quote only short prefixes).
MAX_STATUS_MESSAGE_CHARS = 500


class ServiceError(Exception):
    """A refusal decided by the service itself (loading, draining, overloaded, not found...)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class StreamStalled(ServiceError):
    """The client read nothing for --stream-stall-timeout while a message waited on its flow control."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the stream was aborted: the client read nothing for {timeout_s:g} s (--stream-stall-timeout)",
        )


def status_for(exc: BaseException) -> status_pb2.Status | None:
    """The google.rpc.Status a known error maps to; None for anything else (a bug: gRPC reports UNKNOWN)."""
    if isinstance(exc, InvalidRequest):
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.reason)
        status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=clip(str(exc), MAX_STATUS_MESSAGE_CHARS))
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        return status
    if isinstance(exc, QueueFull):
        status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=f"engine queue is full: {exc}")
        return _with_retry_info(status, RETRY_DELAY_S)
    if isinstance(exc, EngineDead):
        return status_pb2.Status(code=code_pb2.UNAVAILABLE, message=f"engine is dead: {exc}")
    if isinstance(exc, StoreUnavailable):
        message = f"{exc}; calls without a session id are still served"
        return status_pb2.Status(code=code_pb2.UNAVAILABLE, message=clip(message, MAX_STATUS_MESSAGE_CHARS))
    if isinstance(exc, LeaseLost):
        message = "the turn was not kept: its lease on the session expired and another call continued it; retry"
        return status_pb2.Status(code=code_pb2.ABORTED, message=message)
    if isinstance(exc, ServiceError):
        status = status_pb2.Status(code=exc.code.value[0], message=clip(exc.message, MAX_STATUS_MESSAGE_CHARS))
        return status if exc.retry_after_s is None else _with_retry_info(status, exc.retry_after_s)
    return None


def _with_retry_info(status: status_pb2.Status, delay_s: float) -> status_pb2.Status:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(delay_s * 1e9))
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status


def _scoped(identity: str | None, name: str) -> str:
    """`name` within `identity`'s namespace; injective, and `name` itself when authentication is off."""
    return name if identity is None else f"{len(identity)}:{identity}/{name}"


def _engine_request_id(identity: str | None, request_id: str) -> str:
    """The engine's id for a caller's request: request ids are unique per identity, not across them."""
    return _scoped(identity, request_id)


_InFlightKey = tuple[str | None, str]  # (identity, request_id)


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Serves llmserve.v1.GenerateService; answers UNAVAILABLE until `attach()` hands it a started engine."""

    def __init__(self, config: ServerConfig, observers: Sequence[CallObserver] = ()) -> None:
        self._config = config
        self._observers = list(observers)  # told about each Generate call once it ends (metrics, tracing)
        self._engine: Engine | None = None
        self._limits = config.limits
        self._max_prompt_bytes = 0
        self._vocab_size = 0
        self._draining = False
        # (identity, request_id) -> set when that stream has ended
        self._in_flight: dict[_InFlightKey, asyncio.Event] = {}
        self._per_identity: Counter[str | None] = Counter()
        self._idle = asyncio.Event()
        self._idle.set()
        self._histories: HistoryStore = open_store(config.history)

    def add_observer(self, observer: CallObserver) -> None:
        """Tell `observer` about each Generate call from now on, once the call ends."""
        self._observers.append(observer)

    @property
    def histories(self) -> HistoryStore:
        """The session history store (the server connects it at start and closes it at stop)."""
        return self._histories

    def attach(self, engine: Engine) -> None:
        """Start serving with `engine` (already started and warmed up)."""
        info = engine.model_info
        self._max_prompt_bytes = prompt_byte_limit(self._limits, info.context_length)
        self._vocab_size = info.vocab_size
        self._engine = engine
        if self._config.history.max_tokens is None:
            self._histories.max_tokens = engine.model_info.context_length

    def begin_drain(self) -> None:
        """Refuse new Generate streams from now on; those in flight go on."""
        self._draining = True

    @property
    def num_streams(self) -> int:
        """Generate streams in flight."""
        return len(self._in_flight)

    async def wait_idle(self) -> None:
        """Return once no Generate stream is in flight."""
        await self._idle.wait()

    def _ready_engine(self) -> Engine:
        if self._engine is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self._engine

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        identity = caller_identity()
        record = CallRecord(request.request_id or "-", time.monotonic(), identity=identity)
        remaining = context.time_remaining()
        call_deadline = None if remaining is None else time.monotonic() + remaining
        key: _InFlightKey | None = None
        turn: Turn | None = None
        try:
            engine = self._ready_engine()
            check_generate(request, self._limits, self._max_prompt_bytes, self._vocab_size)
            request_id = record.request_id = request.request_id or uuid.uuid4().hex
            key = await self._admit(identity, request_id)
            session_key = self._session_key(context, request.session_id) if request.session_id else None
            engine_id = _engine_request_id(identity, request_id)
            # The history store is keyed per identity too: the request id it names is the caller's own.
            prompt_ids, turn = await self._session_prompt(engine, request, request_id, session_key)
            gen_request = self._to_generation_request(
                engine, request, engine_id, prompt_ids, session_key, call_deadline, identity
            )
            record.prompt_tokens = len(gen_request.prompt_token_ids)
            if self._config.log_prompts:
                record.prompt = _input_text(request)
            record.queued = time.monotonic()
            # aclosing: however this call ends, the engine request is aborted before the log line is written.
            async with contextlib.aclosing(self._stream(engine, gen_request, request, record, turn)) as responses:
                async for response in responses:
                    yield response
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
            status = status_for(exc)
            record.status = _CODE_NAMES[status.code] if status else type(exc).__name__
            if isinstance(exc, (InvalidRequest, QueueFull, EngineDead)):
                record.queued = None  # the engine refused it before taking it
            elif isinstance(exc, StreamStalled):
                record.finish_reason = "cancelled"
            raise
        finally:
            if turn is not None:
                await turn.release()
            if key is not None:
                self._release(key)
            self._record_end(record, bool(request.session_id), context)

    def _record_end(self, record: CallRecord, has_session: bool, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Close the call's record once; the log line, the metrics and the trace are all made from it."""
        record.close(has_session=has_session, metadata=context.invocation_metadata())
        log_call(record)
        for observer in self._observers:
            try:
                observer.call_finished(record)
            except Exception:  # an observer's bug must not fail the call or the others
                log.exception("call observer %r failed", observer)

    async def _admit(self, identity: str | None, request_id: str) -> _InFlightKey:
        """Count a new stream in, or refuse it (draining, at a limit, duplicate id). Returns its key for
        `_release`."""
        key = (identity, request_id)
        while (previous := self._in_flight.get(key)) is not None:
            # A caller that cancels a call and reuses its id at once sends the new call right behind the
            # cancellation, which reaches the old handler a moment later: let it end before calling the id a
            # duplicate.
            try:
                await asyncio.wait_for(previous.wait(), REUSE_WAIT_S)
            except TimeoutError:
                raise ServiceError(
                    grpc.StatusCode.ALREADY_EXISTS, f"request_id {quote_prefix(request_id)} is already in flight"
                ) from None
        if self._draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if len(self._in_flight) >= self._config.max_concurrent_streams:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self._in_flight)} Generate streams in flight, the server's limit (--max-concurrent-streams); "
                "retry later",
                retry_after_s=RETRY_DELAY_S,
            )
        cap = self._config.max_streams_per_identity
        if cap is not None and self._per_identity[identity] >= cap:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{cap} Generate streams in flight for this caller, the limit (--max-streams-per-identity); "
                "retry later",
                retry_after_s=RETRY_DELAY_S,
            )
        self._in_flight[key] = asyncio.Event()
        self._per_identity[identity] += 1
        self._idle.clear()
        return key

    def _release(self, key: _InFlightKey) -> None:
        self._in_flight.pop(key).set()
        identity = key[0]
        self._per_identity[identity] -= 1
        if not self._per_identity[identity]:
            del self._per_identity[identity]
        if not self._in_flight:
            self._idle.set()

    async def _stream(
        self,
        engine: Engine,
        gen_request: GenerationRequest,
        request: pb.GenerateRequest,
        record: CallRecord,
        turn: Turn | None = None,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Yield one response per delta; raise for endings that are not a normal finish."""
        options = request.response
        prompt_ids = gen_request.prompt_token_ids if options.prompt_token_ids else ()
        try:
            # aclosing: a cancel while we wait on the client still closes (and so aborts) the engine request.
            async with contextlib.aclosing(cast(AsyncGenerator[Delta, None], engine.generate(gen_request))) as deltas:
                async for delta in deltas:
                    record.observe(delta)
                    if turn is not None and delta.finish_reason is not FinishReason.DEADLINE:
                        await turn.observe(delta)  # commits the history before the caller sees the last message
                    yield _to_response(record.request_id, delta, options, prompt_ids)
                    prompt_ids = ()
                    if delta.finish_reason is FinishReason.DEADLINE:
                        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
                    if delta.finish_reason is FinishReason.CANCELLED:
                        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the server cancelled the request (shutdown)")
                    if delta.finish_reason is FinishReason.ERROR:
                        raise ServiceError(grpc.StatusCode.INTERNAL, f"generation failed: {delta.error}")
        except InvalidRequest as exc:
            raise _for_caller(exc, request) from None

    def _to_generation_request(
        self,
        engine: Engine,
        request: pb.GenerateRequest,
        request_id: str,
        prompt_ids: Sequence[int],
        session_key: str | None,
        call_deadline: float | None,
        identity: str | None,
    ) -> GenerationRequest:
        s, st = request.sampling, request.stopping
        sampling = SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            seed=s.seed if s.HasField("seed") else None,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            logit_bias=tuple(sorted(s.logit_bias.items())),
        )
        if st.HasField("max_new_tokens"):
            max_new_tokens = st.max_new_tokens
        else:
            info = engine.model_info
            room = info.context_length - len(prompt_ids)
            # At least 1, so that a prompt that fills the context is reported as such by the engine.
            max_new_tokens = max(1, min(self._config.default_max_new_tokens, info.max_new_tokens, room))
        stopping = StoppingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=st.min_new_tokens,
            stop_sequences=tuple(st.stop_sequences),
            stop_token_ids=tuple(st.stop_token_ids),
            include_stop_sequence=st.include_stop_sequence,
            ignore_eos=st.ignore_eos,
        )
        return GenerationRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_ids),
            sampling=sampling,
            stopping=stopping,
            session_id=session_key,
            deadline=None if call_deadline is None else call_deadline - DEADLINE_MARGIN_S,
            priority=request.priority,
            logprobs=request.response.logprobs or request.response.top_logprobs > 0,
            top_logprobs=request.response.top_logprobs,
            # With authentication on, a caller's prompts share cached blocks only with its own (unless shared).
            cache_salt=None if identity is None or self._config.shared_prefix_cache else identity,
            constraint=_constraint_spec(request.constraint),
            n=max(1, request.n),  # 0 (unset) means one
        )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.TokenizeResponse:
        tokenizer = self._ready_engine().tokenizer
        check_input(request, self._limits, self._max_prompt_bytes)
        ids = await _prompt_token_ids(tokenizer, request)
        return pb.TokenizeResponse(token_ids=ids, tokens=tokenizer.convert_ids_to_tokens(ids))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        info = self._ready_engine().model_info
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
        )

    async def GetSession(
        self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetSessionResponse:
        engine = self._ready_engine()
        if not request.session_id:
            raise InvalidRequest("session_id", "must not be empty")
        info = held = None
        # An id no Generate call could have used names no session: the same NOT_FOUND as any unknown id.
        if is_valid_id(request.session_id, self._limits.max_session_id_length):
            key = self._session_key(context, request.session_id)
            info = await engine.get_session(key)
            held = await self._histories.get(key)
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

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteSessionResponse:
        engine = self._ready_engine()
        if not request.session_id:
            raise InvalidRequest("session_id", "must not be empty")
        if not is_valid_id(request.session_id, self._limits.max_session_id_length):
            return pb.DeleteSessionResponse(deleted=False)
        key = self._session_key(context, request.session_id)
        held = await self._histories.delete(key)
        cached = await engine.delete_session(key)
        return pb.DeleteSessionResponse(deleted=held or cached)

    # -- sessions: keys, histories and append mode (history/ holds the book-keeping) ---------------

    def _session_key(self, context: grpc.aio.ServicerContext[Any, Any], session_id: str) -> str:
        """The key a caller's session id is stored under, in the engine's cache and in the history store.

        Every session-id use goes through here. With authentication on, two identities' equal session ids
        are two sessions, and neither can read, continue or delete the other's.
        """
        return _scoped(caller_identity(), session_id)

    async def _session_prompt(
        self, engine: Engine, request: pb.GenerateRequest, request_id: str, session_key: str | None
    ) -> tuple[list[int], Turn | None]:
        """The prompt's token ids, and the session turn that will record the history (None without a session).

        In append mode (continue_session) the prompt is the held history followed by the new input.
        """
        if session_key is None:
            if request.continue_session:
                raise InvalidRequest("session_id", "must be set with continue_session")
            return await _prompt_token_ids(engine.tokenizer, request), None
        try:
            turn = await self._histories.start(session_key, request_id, continues=request.continue_session)
        except NoHistory as exc:
            why = f" ({exc.reason})" if exc.reason else ""
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"session {quote_prefix(request.session_id)} holds no history to continue{why}; "
                "resend the whole conversation without continue_session to start it again",
            ) from None
        except HistoryBusy as exc:
            raise ServiceError(
                grpc.StatusCode.ABORTED,
                f"session {quote_prefix(request.session_id)} is being continued by request "
                f"{quote_prefix(exc.request_id)}; "
                "retry once it has finished",
            ) from None
        try:
            await self._begin_turn(engine, request, turn)
        except BaseException:
            await turn.release()
            raise
        return turn.prompt_ids, turn

    async def _begin_turn(self, engine: Engine, request: pb.GenerateRequest, turn: Turn) -> None:
        """Tell the turn its prompt: the input as it is, or in append mode the held history and the new input."""
        kind = request.WhichOneof("input")
        tokenizer = engine.tokenizer
        if not turn.continues:
            ids = await _prompt_token_ids(tokenizer, request)
            if kind == "chat":
                turn.begin(HistoryInput.CHAT, ids, [(m.role, m.content) for m in request.chat.messages])
            else:
                turn.begin(HistoryInput.TOKENS, ids)
            return
        if kind == "chat":
            new = [(m.role, m.content) for m in request.chat.messages]
            if not new:
                raise InvalidRequest("chat.messages", "must not be empty")
            messages = self._histories.continue_chat(turn, new)
            # The whole conversation is rendered again, as a caller resending it would have it rendered.
            turns = [pb.ChatMessage(role=role, content=content) for role, content in messages]
            turn.begin(HistoryInput.CHAT, await asyncio.to_thread(_chat_token_ids, tokenizer, turns), messages)
        elif kind == "text":
            if not request.text:
                raise InvalidRequest("text", "must not be empty")
            if tokenizer is None:
                raise InvalidRequest("text", "the model has no tokenizer: send token_ids")
            # No special tokens: the new text goes on in the middle of a conversation.
            new_ids = await asyncio.to_thread(tokenizer.encode, request.text, add_special_tokens=False)
            turn.begin(HistoryInput.TOKENS, self._histories.continue_tokens(turn, new_ids, "text"))
        elif kind == "token_ids":
            if not request.token_ids.ids:
                raise InvalidRequest("token_ids.ids", "must not be empty")
            turn.begin(HistoryInput.TOKENS, self._histories.continue_tokens(turn, request.token_ids.ids, "token_ids"))
        else:
            await _prompt_token_ids(tokenizer, request)  # raises: no input
        self._histories.check_length(len(turn.prompt_ids))


def _for_caller(exc: InvalidRequest, request: pb.GenerateRequest) -> InvalidRequest:
    """Re-name an engine field after the request field the caller set."""
    if exc.field == "prompt":
        path = request.WhichOneof("input") or "input"
    else:
        path = _FIELD_PATHS.get(exc.field, exc.field)
    return InvalidRequest(path, exc.reason)


async def _prompt_token_ids(tokenizer: Any, request: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
    """Token ids of the request's input: text and chat go through the tokenizer, off the event loop."""
    kind = request.WhichOneof("input")
    if kind is None:
        choices = ", ".join(field.name for field in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        raise InvalidRequest("input", f"set one of {choices}")
    if kind == "token_ids":
        assert isinstance(request, pb.GenerateRequest)  # only a GenerateRequest carries token ids
        return list(request.token_ids.ids)
    if tokenizer is None:
        raise InvalidRequest(kind, "the model has no tokenizer: send token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text", "must not be empty")
        ids: list[int] = await asyncio.to_thread(tokenizer.encode, request.text)
        return ids
    return await asyncio.to_thread(_chat_token_ids, tokenizer, request.chat.messages)


def _chat_token_ids(tokenizer: Any, messages: Sequence[pb.ChatMessage]) -> list[int]:
    if not messages:
        raise InvalidRequest("chat.messages", "must not be empty")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("chat", "the model has no chat template: send text or token_ids")
    turns = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template itself rejects the conversation (e.g. roles must alternate)
        # The template's message may quote the conversation: keep it short.
        raise InvalidRequest("chat.messages", f"the chat template rejects it: {clip(str(exc), 200)}") from None
    # The template already wrote the special tokens it wants.
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def _constraint_spec(constraint: pb.Constraint) -> ConstraintSpec | None:
    """The request's constraint as the engine takes it; None when unset (or json_object: false)."""
    kind = constraint.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not constraint.json_object):
        return None
    if kind == "choice":
        return ConstraintSpec(ConstraintKind.CHOICE, choices=tuple(constraint.choice.options))
    text = "" if kind == "json_object" else getattr(constraint, kind)
    return ConstraintSpec(ConstraintKind(kind), text)


def _input_text(request: pb.GenerateRequest) -> str:
    kind = request.WhichOneof("input")
    if kind == "text":
        return clip(request.text, MAX_LOGGED_PROMPT_CHARS)
    if kind == "chat":
        return clip(" | ".join(f"{m.role}: {m.content}" for m in request.chat.messages), MAX_LOGGED_PROMPT_CHARS)
    return f"<{len(request.token_ids.ids)} token ids>"


def _to_response(
    request_id: str, delta: Delta, options: pb.ResponseOptions, prompt_ids: Sequence[int]
) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=request_id, text=delta.text, prompt_token_ids=prompt_ids, index=delta.index
    )
    if options.token_ids:
        response.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        response.logprobs.extend(_logprob_pb(lp) for lp in delta.logprobs)
    if delta.finish_reason is not None:
        response.finish_reason = pb.FinishReason.Value(  # type: ignore[assignment]  # the stubs want the enum type
            f"FINISH_REASON_{delta.finish_reason.name}"
        )
    for usage, target in ((delta.usage, response.usage), (delta.total_usage, response.total_usage)):
        if usage is not None:
            target.SetInParent()
            target.prompt_tokens = usage.prompt_tokens
            target.cached_prompt_tokens = usage.cached_prompt_tokens
            target.completion_tokens = usage.completion_tokens
    if delta.timing is not None:
        t = delta.timing
        response.timing.SetInParent()
        response.timing.queue_seconds = t.queue_s
        response.timing.time_to_first_token_seconds = t.ttft_s
        response.timing.total_seconds = t.total_s
    if delta.seed is not None:
        response.seed = delta.seed
    return response


def _logprob_pb(lp: TokenLogprob) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top]
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_logprobs=top)
