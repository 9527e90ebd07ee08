"""The synchronous client."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from llmserve_client import health
from llmserve_client.auth import resolve_token
from llmserve_client.channel import DEFAULT_OPTIONS, TLS, open_channel
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc
from llmserve_client.request import Message, build_request, tokenize_request

_DEFAULT = object()  # "use the client's timeout", distinct from None ("no deadline")


class Client:
    """A blocking llmserve client over one channel.

    `timeout` is the default deadline of every call in seconds (None: no deadline); each method takes its
    own `timeout` too. `tls`: None or False for plaintext, True for TLS with the system's roots, or a TLS
    object. `token` (or the first line of `token_file`): sent as `authorization: Bearer <token>` on every
    call, for a server with --auth-token-file. Errors surface as grpc.RpcError (its .code() and .details()
    say what went wrong).
    """

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
        self._channel = open_channel(target, tls, options, aio=False, token=token)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._health_check = health.check_method(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout: Any) -> float | None:
        return self.timeout if timeout is _DEFAULT else timeout

    def generate(
        self, prompt: str | pb.GenerateRequest | None = None, *, timeout: Any = _DEFAULT, **options: Any
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the responses for a prompt (or `messages=` / `token_ids=`; see build_request for options),
        or for a ready GenerateRequest. Closing the iterator early cancels the call on the server."""
        request = prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **options)
        call = self._stub.Generate(request, timeout=self._timeout(timeout))
        try:
            yield from call
        finally:
            call.cancel()  # no-op when the stream already ended

    def generate_text(self, prompt: str | pb.GenerateRequest | None = None, **options: Any) -> str:
        """The whole completion as one string (same arguments as generate)."""
        return "".join(r.text for r in self.generate(prompt, **options))

    def tokenize(
        self, text: str | None = None, *, messages: Iterable[Message] | None = None, timeout: Any = _DEFAULT
    ) -> list[int]:
        """The token ids Generate would feed the model for this text or conversation."""
        response = self._stub.Tokenize(tokenize_request(text, messages=messages), timeout=self._timeout(timeout))
        return list(response.token_ids)

    def model_info(self, *, timeout: Any = _DEFAULT) -> pb.GetModelInfoResponse:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout))

    def health(self, service: str = "", *, timeout: Any = _DEFAULT) -> str:
        """The grpc.health.v1 status of the server ("") or a service: "SERVING", "NOT_SERVING", ..."""
        response = self._health_check(health.HealthCheckRequest(service=service), timeout=self._timeout(timeout))
        return health.status_name(response)

    def get_session(self, session_id: str, *, timeout: Any = _DEFAULT) -> pb.GetSessionResponse | None:
        """What the server caches for a session, or None when it caches nothing."""
        try:
            return self._stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=self._timeout(timeout))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def delete_session(self, session_id: str, *, timeout: Any = _DEFAULT) -> bool:
        """Free a session's cache; True when there was one."""
        request = pb.DeleteSessionRequest(session_id=session_id)
        return self._stub.DeleteSession(request, timeout=self._timeout(timeout)).deleted
