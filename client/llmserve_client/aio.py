"""The asyncio client: the same methods as Client, as coroutines and async iterators."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from llmserve_client import health
from llmserve_client.auth import resolve_token
from llmserve_client.channel import DEFAULT_OPTIONS, TLS, open_channel
from llmserve_client.conversation import AsyncConversation, chat_request
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc
from llmserve_client.request import EmbedItem, Message, build_request, embed_request, texts_by_index, tokenize_request
from llmserve_client.retry import DEFAULT_RETRY, Attempts, CallInfo, Metadata, Retry, session_metadata

_DEFAULT = object()
T = TypeVar("T")


class AsyncClient:
    """A grpc.aio llmserve client; see Client for the arguments. Use inside one event loop."""

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        timeout: float | None = None,
        tls: TLS | bool | None = None,
        options: Sequence[tuple[str, Any]] = DEFAULT_OPTIONS,
        retry: Retry = DEFAULT_RETRY,
        token: str | None = None,
        token_file: str | Path | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry
        token = resolve_token(token, token_file, env={})
        self._channel = open_channel(target, tls, options, aio=True, token=token)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._health_check = health.check_method(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _timeout(self, timeout: Any) -> float | None:
        return self.timeout if timeout is _DEFAULT else timeout

    async def generate(
        self,
        prompt: str | pb.GenerateRequest | None = None,
        *,
        timeout: Any = _DEFAULT,
        info: CallInfo | None = None,
        **options: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the responses (see Client.generate). Closing the iterator or cancelling the task
        cancels the call on the server."""
        request = prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **options)
        attempts = Attempts(self.retry, self._timeout(timeout), info)
        metadata = session_metadata(request.session_id)
        while True:
            call = self._stub.Generate(request, timeout=attempts.start(), metadata=metadata)
            received = False
            try:
                async for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as error:
                delay = None if received else attempts.retry_after(error)
                if delay is None:
                    raise
            finally:
                call.cancel()
                if call.done():
                    attempts.info.record(await call.trailing_metadata())
            await asyncio.sleep(delay)

    async def generate_text(self, prompt: str | pb.GenerateRequest | None = None, **options: Any) -> str:
        return "".join([r.text async for r in self.generate(prompt, **options)])

    async def generate_texts(self, prompt: str | pb.GenerateRequest | None = None, **options: Any) -> list[str]:
        """The whole text of each of the n completions (`n=`), in index order (see Client.generate_texts)."""
        return texts_by_index([r async for r in self.generate(prompt, **options)])

    async def chat(
        self,
        message: str,
        *,
        session_id: str,
        new: bool = False,
        system: str | None = None,
        timeout: Any = _DEFAULT,
        **options: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the answer to one user message of a held conversation (see Client.chat)."""
        request = chat_request(message, session_id=session_id, new=new, system=system, **options)
        async for response in self.generate(request, timeout=timeout):
            yield response

    def conversation(
        self, session_id: str | None = None, *, system: str | None = None, resume: bool = False, **options: Any
    ) -> AsyncConversation:
        """An AsyncConversation under `session_id` (a new random one when None)."""
        return AsyncConversation(self, session_id, system=system, resume=resume, **options)

    async def tokenize(
        self, text: str | None = None, *, messages: Iterable[Message] | None = None, timeout: Any = _DEFAULT
    ) -> list[int]:
        request = tokenize_request(text, messages=messages)
        response = await self._unary(self._stub.Tokenize, request, timeout)
        return list(response.token_ids)

    async def embed(
        self, inputs: str | Iterable[EmbedItem] | pb.EmbedRequest, *, timeout: Any = _DEFAULT, **options: Any
    ) -> pb.EmbedResponse:
        """The vectors of one text or a batch of inputs (see Client.embed)."""
        request = inputs if isinstance(inputs, pb.EmbedRequest) else embed_request(inputs, **options)
        return await self._unary(self._stub.Embed, request, timeout)

    async def rerank(
        self, query: str | pb.RerankRequest, documents: Iterable[str] = (), *, timeout: Any = _DEFAULT, **options: Any
    ) -> pb.RerankResponse:
        """The documents' scores against `query` by a cross-encoder (see Client.rerank)."""
        request = (
            query
            if isinstance(query, pb.RerankRequest)
            else pb.RerankRequest(query=query, documents=documents, **options)
        )
        return await self._unary(self._stub.Rerank, request, timeout)

    async def model_info(self, *, timeout: Any = _DEFAULT) -> pb.GetModelInfoResponse:
        return await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def health(self, service: str = "", *, timeout: Any = _DEFAULT) -> str:
        request = health.HealthCheckRequest(service=service)
        return health.status_name(await self._health_check(request, timeout=self._timeout(timeout)))

    async def get_session(self, session_id: str, *, timeout: Any = _DEFAULT) -> pb.GetSessionResponse | None:
        try:
            request = pb.GetSessionRequest(session_id=session_id)
            return await self._unary(self._stub.GetSession, request, timeout, session_metadata(session_id))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    async def delete_session(self, session_id: str, *, timeout: Any = _DEFAULT) -> bool:
        request = pb.DeleteSessionRequest(session_id=session_id)
        metadata = session_metadata(session_id)
        response: pb.DeleteSessionResponse = await self._stub.DeleteSession(
            request, timeout=self._timeout(timeout), metadata=metadata
        )
        return response.deleted

    async def _unary(
        self, method: Callable[..., Awaitable[T]], request: Any, timeout: Any, metadata: Metadata = ()
    ) -> T:
        """An idempotent unary call, retried as `self.retry` says."""
        attempts = Attempts(self.retry, self._timeout(timeout))
        while True:
            try:
                return await method(request, timeout=attempts.start(), metadata=metadata)
            except grpc.RpcError as error:
                delay = attempts.retry_after(error)
                if delay is None:
                    raise
            await asyncio.sleep(delay)
