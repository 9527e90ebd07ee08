"""The vLLM engine protocol's servicer (`vllm.grpc.engine.VllmEngine`, from the pinned smg-grpc-proto), served on the
same port as llmserve.v1.GenerateService, so that the smg gateway and the Kubernetes inference gateway can front
llmserve's replicas.

A second edge over the same call: Generate translates the vLLM request (vllm_convert.py) and hands it to
`GenerateServicer.serve`, which admits it (the same stream caps, identity scoping of request ids and prefix
cache), bounds and checks it, runs it on the engine and closes its one call record (log line, metrics, trace);
this module only writes the deltas back in vLLM's shape and renames the fields of refusals. The rest answers what
smg asks of a worker: health, model and server facts, loads, the tokenizer, aborts by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from llmserve.api import tokenizer_files
from llmserve.api.admission import StreamKey
from llmserve.api.errors import ServiceError
from llmserve.api.kv_publisher import KvEventPublisher
from llmserve.api.servicer import Call, GenerateServicer
from llmserve.api.vllm_convert import (
    Completion,
    LogprobCounts,
    chunk,
    complete,
    in_vllm_terms,
    to_llmserve_request,
)
from llmserve.auth import caller_identity
from llmserve.engine.types.errors import InvalidRequest
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from llmserve.engine.types.protocol import Engine

log = logging.getLogger("llmserve")

VLLM_SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "vllm-grpc"  # what GetServerInfo calls this server (vLLM's own says the same)


def kv_usage(engine: Engine) -> tuple[int, int, float]:
    """Running and waiting requests, and the share of the KV pool's blocks held (by running requests or sessions;
    cached free blocks do not count: they are allocatable), in [0, 1]."""
    s = engine.stats()
    return s.running, s.waiting, s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]  # smg-grpc-proto is untyped
    """Serves vllm.grpc.engine.VllmEngine over the same calls as `edge` (GenerateService's servicer)."""

    def __init__(self, edge: GenerateServicer, kv_batch_sent: Callable[[], None] | None = None) -> None:
        """`kv_batch_sent` is called for each KV event batch a SubscribeKvEvents stream was given."""
        self._edge = edge
        self._started = time.time()
        self._tokenizer = tokenizer_files.TokenizerBundle()
        self._kv_events = KvEventPublisher(lambda: edge.engine, kv_batch_sent)
        # The Generate calls in flight by (identity, request id), for Abort.
        self._calls: dict[StreamKey, set[_Abort]] = {}

    def close(self) -> None:
        """Stop publishing KV events; remove the tokenizer files written for gateways."""
        self._kv_events.close()
        self._tokenizer.close()

    async def Generate(
        self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[vpb.GenerateResponse]:
        s = request.sampling_params
        call = Call(request.request_id)
        counts: LogprobCounts | None = None  # once the request is built: its prompt's ids
        whole: dict[int, Completion] = {}
        ended: set[int] = set()
        key = (caller_identity(), request.request_id)
        task = asyncio.current_task()
        assert task is not None
        abort = _Abort(task)
        self._calls.setdefault(key, set()).add(abort)
        try:
            deltas = self._edge.serve(call, lambda: to_llmserve_request(request), context)
            async with contextlib.aclosing(deltas):
                while not abort.requested:
                    try:
                        abort.waiting = True
                        delta = await anext(deltas)
                    except StopAsyncIteration:
                        break
                    except asyncio.CancelledError:
                        if not abort.requested:
                            raise  # the caller's cancel
                        task.uncancel()  # our own Abort's: the stream ends below
                        break
                    finally:
                        abort.waiting = False
                    if counts is None:
                        counts = _counts(s, call)
                    try:
                        if request.stream:
                            if delta.token_ids:
                                yield chunk(delta, call.record.prompt_tokens, counts)
                        else:
                            whole.setdefault(delta.index, Completion()).add(delta)
                        if delta.finished:
                            ended.add(delta.index)
                            yield complete(delta, counts, whole.get(delta.index))
                    except Exception as exc:  # thrown in at a yield (a stalled reader): the call's record sees it
                        await deltas.athrow(exc)
                        raise
            if abort.requested:  # Abort: each completion still open ends "abort", and the stream closes
                for index in sorted(set(range(max(1, s.n))) - ended):
                    yield vpb.GenerateResponse(complete=vpb.GenerateComplete(finish_reason="abort", index=index))
        except InvalidRequest as exc:
            raise in_vllm_terms(exc) from None
        finally:
            calls = self._calls[key]
            calls.discard(abort)
            if not calls:
                del self._calls[key]

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]) -> vpb.AbortResponse:
        """End the caller's own Generate calls with these request ids (an id of another identity, or of no call, is
        no call of this caller: nothing happens). Each engine request is freed within a step; its stream ends with
        finish reason "abort"."""
        identity = caller_identity()
        for request_id in request.request_ids:
            for abort in self._calls.get((identity, request_id), ()):
                abort.request()
        return vpb.AbortResponse()

    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> vpb.HealthCheckResponse:
        engine = self._edge.engine
        if engine is None:
            return vpb.HealthCheckResponse(healthy=False, message="the model is still loading")
        if engine.dead:
            return vpb.HealthCheckResponse(healthy=False, message=f"the engine is dead: {engine.dead_reason}")
        if self._edge.admission.draining:
            return vpb.HealthCheckResponse(healthy=False, message="the server is draining")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> vpb.GetModelInfoResponse:
        engine = self._edge.ready_engine()
        info, tokenizer = engine.model_info, engine.tokenizer
        # tokenizer_path: a folder this server wrote, which a gateway on the same machine reads as it is; one
        # elsewhere (another pod) finds no such folder and asks GetTokenizer for the same files.
        files = None if tokenizer is None else await self._tokenizer_files(engine)
        folder = "" if files is None else str(files.folder)
        return vpb.GetModelInfoResponse(
            served_model_name=info.name,
            # False for an embedding model: smg then routes /v1/embeddings (and nothing that generates) to it.
            is_generation="generate" in info.tasks,
            max_context_length=info.context_length,
            max_req_input_len=info.context_length - 1 if "generate" in info.tasks else info.max_embed_input_tokens,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            bos_token_id=_token_id(tokenizer, "bos_token_id"),
            pad_token_id=_token_id(tokenizer, "pad_token_id"),
            tokenizer_path=folder,
        )

    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> vpb.GetServerInfoResponse:
        engine = self._edge.ready_engine()
        info, stats = engine.model_info, engine.stats()
        return vpb.GetServerInfoResponse(
            active_requests=self._edge.num_streams,
            is_paused=self._edge.admission.draining,
            uptime_seconds=time.time() - self._started,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            block_size=stats.block_size,
            model_dtype=info.dtype,
        )

    async def GetLoads(
        self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> vpb.GetLoadsResponse:
        engine = self._edge.ready_engine()
        running, waiting, usage = kv_usage(engine)
        stats = engine.stats()
        load = vpb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            num_used_tokens=stats.kv_blocks_used * stats.block_size,
            max_total_num_tokens=stats.kv_blocks_total * stats.block_size,
            token_usage=usage,
        )
        return vpb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=_version(), dp_rank_count=1, loads=[load]
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        engine = self._edge.ready_engine()
        if engine.tokenizer is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "the model has no tokenizer (random weights)")
        files = await self._tokenizer_files(engine)
        if files is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "the tokenizer cannot be written as files")
        for part, digest in tokenizer_files.chunks(files.zip_bytes, files.sha256):
            yield common_pb2.GetTokenizerChunk(data=part, sha256=digest)

    async def _tokenizer_files(self, engine: Engine) -> tokenizer_files.TokenizerFiles | None:
        try:
            return await self._tokenizer.get(engine.tokenizer, engine.model_info.eos_token_ids)
        except Exception:  # a tokenizer transformers cannot save: gateways must bring their own
            log.exception("the tokenizer could not be written as files for gateways")
            return None

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's stored and removed blocks, from `start_sequence_number` (kv_publisher.py): only those
        of the caller's own cache salt. The response headers go out at once: smg waits 2 s for a subscription to
        answer and otherwise marks the replica unreachable, and an idle replica has no batch to send."""
        salt = self._edge.cache_salt(caller_identity())
        await context.send_initial_metadata(())
        async for batch in self._kv_events.subscribe(salt, request.start_sequence_number):
            yield batch

    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext[Any, Any]) -> vpb.EmbedResponse:
        """One tokenized input's vector, as llmserve.v1's Embed makes it (the model's pooling and normalization, the
        same checks, log line and metrics): what smg sends /v1/embeddings to, one call per input. A model that serves
        no Embed is FAILED_PRECONDITION; an input over GetModelInfo's max_req_input_len is INVALID_ARGUMENT naming
        `tokenized.input_ids` (vLLM's protocol has no truncation)."""
        ids = pb.TokenIds(ids=request.tokenized.input_ids)
        own = pb.EmbedRequest(request_id=request.request_id, inputs=[pb.EmbedInput(token_ids=ids)])
        try:
            response = await self._edge.Embed(own, context)
        except InvalidRequest as exc:
            field = "tokenized.input_ids" if exc.field.startswith("inputs") else exc.field
            raise InvalidRequest(field, exc.reason) from None
        (embedding,) = response.embeddings
        return vpb.EmbedResponse(
            embedding=embedding.values, prompt_tokens=embedding.prompt_tokens, embedding_dim=len(embedding.values)
        )

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> common_pb2.FlushCacheResponse:
        raise _unimplemented("FlushCache", "the prefix cache is evicted least recently used first")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> common_pb2.ProfileResponse:
        raise _unimplemented("StartProfile", "profile with py-spy or the benchmarks' probes")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> common_pb2.ProfileResponse:
        raise _unimplemented("StopProfile", "profile with py-spy or the benchmarks' probes")


@dataclass(slots=True, eq=False)
class _Abort:
    """An Abort of one Generate call. It interrupts the call only while the call waits for the engine's next delta
    (cancelling its task there, which closes the engine's stream); while a message is being written it only marks
    the call, which ends when the write is done. A cancel anywhere else would end the call with no status."""

    task: asyncio.Task[Any]
    waiting: bool = False
    requested: bool = False

    def request(self) -> None:
        if not self.requested:
            self.requested = True
            if self.waiting:
                self.task.cancel()


def _unimplemented(method: str, why: str = "") -> ServiceError:
    tail = f": {why}" if why else ""
    return ServiceError(grpc.StatusCode.UNIMPLEMENTED, f"llmserve does not implement VllmEngine/{method}{tail}")


def _token_id(tokenizer: Any, name: str) -> int:
    value = getattr(tokenizer, name, None) if tokenizer is not None else None
    return value if isinstance(value, int) else 0


def _version() -> str:
    from importlib import metadata

    try:
        return f"llmserve {metadata.version('llmserve')}"
    except metadata.PackageNotFoundError:
        return "llmserve"


def _counts(s: vpb.SamplingParams, call: Call) -> LogprobCounts:
    """The alternatives the call asked for, and its prompt's ids (once the edge has built its engine request)."""
    top = max(0, s.logprobs) if s.HasField("logprobs") else 0
    prompt_top = max(0, s.prompt_logprobs) if s.HasField("prompt_logprobs") else 0
    prompt_ids = call.engine_request.prompt_token_ids if call.engine_request is not None else ()
    return LogprobCounts(top, prompt_top, prompt_ids)
