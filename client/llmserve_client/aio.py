"""The asyncio client: the same methods as Client, as coroutines and async iterators."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from llmserve_client import health
from llmserve_client.auth import resolve_token
from llmserve_client.channel import DEFAULT_OPTIONS, TLS, open_channel
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc
from llmserve_client.request import Message, build_request, tokenize_request

_DEFAULT = object()


class AsyncClient:
    """A grpc.aio llmserve client; see Client for the arguments. Use inside one event loop."""

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        timeout: float | None = None,
        tls: TLS | bool | None = None,
        options: Sequence[tuple[str, Any]] = DEFAULT_OPTIONS,
        token: str | None = None,
        token_file: str | Path | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
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
        self, prompt: str | pb.GenerateRequest | None = None, *, timeout: Any = _DEFAULT, **options: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the responses (see Client.generate). Closing the iterator or cancelling the task
        cancels the call on the server."""
        request = prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **options)
        call = self._stub.Generate(request, timeout=self._timeout(timeout))
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def generate_text(self, prompt: str | pb.GenerateRequest | None = None, **options: Any) -> str:
        return "".join([r.text async for r in self.generate(prompt, **options)])

    async def tokenize(
        self, text: str | None = None, *, messages: Iterable[Message] | None = None, timeout: Any = _DEFAULT
    ) -> list[int]:
        request = tokenize_request(text, messages=messages)
        response = await self._stub.Tokenize(request, timeout=self._timeout(timeout))
        return list(response.token_ids)

    async def model_info(self, *, timeout: Any = _DEFAULT) -> pb.GetModelInfoResponse:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout))

    async def health(self, service: str = "", *, timeout: Any = _DEFAULT) -> str:
        request = health.HealthCheckRequest(service=service)
        return health.status_name(await self._health_check(request, timeout=self._timeout(timeout)))

    async def get_session(self, session_id: str, *, timeout: Any = _DEFAULT) -> pb.GetSessionResponse | None:
        try:
            request = pb.GetSessionRequest(session_id=session_id)
            return await self._stub.GetSession(request, timeout=self._timeout(timeout))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    async def delete_session(self, session_id: str, *, timeout: Any = _DEFAULT) -> bool:
        request = pb.DeleteSessionRequest(session_id=session_id)
        return (await self._stub.DeleteSession(request, timeout=self._timeout(timeout))).deleted
