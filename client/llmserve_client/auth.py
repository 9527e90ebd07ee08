"""Bearer tokens: sent as `authorization: Bearer <token>` metadata on every call of a channel.

Interceptors rather than call credentials, because gRPC sends call credentials only over TLS and a server
inside a mesh may well be plaintext (the token then travels in the clear: prefer TLS).
"""

from __future__ import annotations

import os
from collections import namedtuple
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "LLMSERVE_TOKEN"
TOKEN_FILE_ENV = "LLMSERVE_TOKEN_FILE"


def read_token_file(path: str | Path) -> str:
    """The token in a file: its first non-empty line, stripped."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            return line.strip()
    raise ValueError(f"{path}: no token in the file")


def resolve_token(
    token: str | None = None, token_file: str | Path | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """The token to send: `token`, else `token_file`'s, else $LLMSERVE_TOKEN, else $LLMSERVE_TOKEN_FILE's; or None."""
    env = os.environ if env is None else env
    if token:
        return token
    if token_file:
        return read_token_file(token_file)
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    if env.get(TOKEN_FILE_ENV):
        return read_token_file(env[TOKEN_FILE_ENV])
    return None


class _Details(
    namedtuple("_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a blocking channel (grpc.intercept_channel)."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _Details:
        metadata = [*(details.metadata or ()), self._entry]
        return _Details(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _AioBearer:
    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class AioBearerUnaryUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class AioBearerUnaryStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


def aio_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the token to every unary and server-streaming call of a grpc.aio channel."""
    return [AioBearerUnaryUnary(token), AioBearerUnaryStream(token)]
