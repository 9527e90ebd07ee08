"""Who is calling: a bearer token from a Kubernetes static token file, or the client certificate (mTLS).

Authentication is off unless `--auth-token-file` or `--identity-from-cert` is given. When it is on, every
RPC except `grpc.health.v1.Health` (and server reflection, unless `--reflection-requires-auth`) must name
its caller, or it ends UNAUTHENTICATED with the same message whether the token was missing or wrong. The
caller's identity is then available to the servicer through `caller_identity()` for the rest of the call.
"""

from __future__ import annotations

import contextvars
import csv
import hashlib
import hmac
import inspect
import io
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger("llmserve.auth")

UNAUTHENTICATED_MESSAGE = "missing or invalid credentials"
_BEARER = "bearer "
_IDENTITY: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmserve_caller_identity", default=None)


def caller_identity() -> str | None:
    """The authenticated identity of the call being served; None when authentication is off."""
    return _IDENTITY.get()


class TokenFileError(ValueError):
    """A token file that cannot be used; the message never contains a token."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def parse_token_file(text: str) -> dict[bytes, str]:
    """SHA-256 of each token -> its identity, from Kubernetes' static token file format.

    One `token,user[,uid[,"group1,group2"]]` per line (CSV); columns after the user are ignored. Blank
    lines and lines starting with `#` are skipped. Only digests are kept, so a token never sits in memory
    as a string longer than the parse.
    """
    tokens: dict[bytes, str] = {}
    first_line: dict[bytes, int] = {}
    for number, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [cell.strip() for cell in row]
        if not any(cells) or cells[0].startswith("#"):
            continue
        if len(cells) < 2 or not cells[0] or not cells[1]:
            raise TokenFileError(f"line {number}: expected token,identity[,...]")
        digest = _digest(cells[0])
        if digest in tokens:
            raise TokenFileError(f"line {number}: the token of line {first_line[digest]} again")
        tokens[digest] = cells[1]
        first_line[digest] = number
    if not tokens:
        raise TokenFileError("no tokens")
    return tokens


class TokenStore:
    """The tokens of one file; `reload()` swaps in a new set atomically, keeping the old one on error."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._tokens = parse_token_file(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, TokenFileError) as exc:
            raise TokenFileError(f"{self.path}: {exc}") from None

    def __len__(self) -> int:
        return len(self._tokens)

    def reload(self) -> bool:
        """Re-read the file; on any error log it and keep the current tokens. Returns whether it took."""
        try:
            tokens = parse_token_file(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, TokenFileError) as exc:
            log.error("auth token file %s not reloaded, keeping %d tokens: %s", self.path, len(self._tokens), exc)
            return False
        self._tokens = tokens
        log.info("auth token file %s reloaded: %d tokens", self.path, len(tokens))
        return True

    def identify(self, token: str) -> str | None:
        """The identity of `token`, or None. Compares against every known token in constant time each,
        without stopping at a match, so the time taken says nothing about which tokens exist."""
        digest = _digest(token)
        found = None
        for known, identity in self._tokens.items():
            if hmac.compare_digest(known, digest):
                found = identity
        return found


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` metadata entry (the scheme is case-insensitive)."""
    for key, value in metadata or ():
        if key != "authorization" or not isinstance(value, str):
            continue
        if value[: len(_BEARER)].lower() == _BEARER and value[len(_BEARER) :].strip():
            return value[len(_BEARER) :].strip()
        return None
    return None


def certificate_identity(auth_context: Mapping[str, Iterable[bytes]]) -> str | None:
    """The client certificate's first subject alternative name, else its common name."""
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        values: Iterable[bytes] = auth_context.get(key) or ()
        for value in values:
            name: str = value.decode("utf-8", "replace").strip()
            if name:
                return name
    return None


class Authenticator:
    """Names the caller of a call from its token (when a token file is set) or its client certificate."""

    def __init__(self, tokens: TokenStore | None, *, from_certificate: bool) -> None:
        if tokens is None and not from_certificate:
            raise ValueError("an Authenticator needs a token file or certificate identities")
        self.tokens = tokens
        self.from_certificate = from_certificate

    def identify(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        if self.tokens is not None:
            token = bearer_token(context.invocation_metadata())
            return None if token is None else self.tokens.identify(token)
        return certificate_identity(context.auth_context())

    def reload(self) -> None:
        """Re-read the token file (SIGHUP); calls in flight keep going with the identity they had."""
        if self.tokens is not None:
            self.tokens.reload()


Behaviour = Callable[..., Any]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known caller (UNAUTHENTICATED), except to the methods under `exempt`
    prefixes; sets `caller_identity()` for the calls it lets through."""

    def __init__(self, authenticator: Authenticator, *, exempt: Sequence[str]) -> None:
        self._authenticator = authenticator
        self._exempt = tuple(exempt)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        kinds = {
            "unary_unary": grpc.unary_unary_rpc_method_handler,
            "unary_stream": grpc.unary_stream_rpc_method_handler,
            "stream_unary": grpc.stream_unary_rpc_method_handler,
            "stream_stream": grpc.stream_stream_rpc_method_handler,
        }
        for kind, make in kinds.items():
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                return make(
                    self._guard(behaviour),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    async def _enter(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        identity = self._authenticator.identify(context)
        if identity is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        # The call runs in its own task: the identity stays set for exactly this call.
        _IDENTITY.set(identity)

    def _guard(self, behaviour: Behaviour) -> Behaviour:
        # grpc.aio tells handler styles apart by function type, so keep the wrapped one's.
        if inspect.isasyncgenfunction(behaviour):

            async def guarded_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                await self._enter(context)
                async for response in behaviour(request, context):
                    yield response

            return guarded_stream

        async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await self._enter(context)
            return await behaviour(request, context)

        return guarded
