"""The synchronous client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from llmserve_client import health
from llmserve_client.auth import resolve_token
from llmserve_client.channel import DEFAULT_OPTIONS, TLS, open_channel
from llmserve_client.conversation import Conversation, chat_request
from llmserve_client.pb.llmserve.v1 import adapters_pb2, adapters_pb2_grpc, generate_pb2_grpc
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from llmserve_client.request import EmbedItem, Message, build_request, embed_request, texts_by_index, tokenize_request
from llmserve_client.retry import DEFAULT_RETRY, Attempts, CallInfo, Metadata, Retry, session_metadata

_DEFAULT = object()  # "use the client's timeout", distinct from None ("no deadline")
T = TypeVar("T")


class Client:
    """A blocking llmserve client over one channel.

    `timeout` is the default deadline of every call in seconds (None: no deadline); each method takes its
    own `timeout` too. `tls`: None or False for plaintext, True for TLS with the system's roots, or a TLS
    object. `token` (or the first line of `token_file`): sent as `authorization: Bearer <token>` on every
    call, for a server with --auth-token-file. Errors surface as grpc.RpcError (its .code() and .details()
    say what went wrong). `retry`: how calls refused with UNAVAILABLE before any response are retried (see
    llmserve_client.retry; NO_RETRY turns it off).
    """

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
        self._channel = open_channel(target, tls, options, aio=False, token=token)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._adapters = adapters_pb2_grpc.AdapterServiceStub(self._channel)
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
        self,
        prompt: str | pb.GenerateRequest | None = None,
        *,
        timeout: Any = _DEFAULT,
        info: CallInfo | None = None,
        **options: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the responses for a prompt (or `messages=` / `token_ids=`; see build_request for options),
        or for a ready GenerateRequest. Closing the iterator early cancels the call on the server.
        `info`, when given, is filled in with the attempts made and the replica that served the call."""
        request = prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **options)
        attempts = Attempts(self.retry, self._timeout(timeout), info)
        metadata = session_metadata(request.session_id)
        while True:
            call = self._stub.Generate(request, timeout=attempts.start(), metadata=metadata)
            received = False
            try:
                for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as error:
                delay = None if received else attempts.retry_after(error)
                if delay is None:
                    raise
            finally:
                call.cancel()  # no-op when the stream already ended
                attempts.info.record(call.trailing_metadata())
            time.sleep(delay)

    def generate_text(self, prompt: str | pb.GenerateRequest | None = None, **options: Any) -> str:
        """The whole completion as one string (same arguments as generate; for n > 1 see generate_texts)."""
        return "".join(r.text for r in self.generate(prompt, **options))

    def generate_texts(self, prompt: str | pb.GenerateRequest | None = None, **options: Any) -> list[str]:
        """The whole text of each of the n completions (`n=`), in index order (same arguments as generate)."""
        return texts_by_index(self.generate(prompt, **options))

    def chat(
        self,
        message: str,
        *,
        session_id: str,
        new: bool = False,
        system: str | None = None,
        timeout: Any = _DEFAULT,
        **options: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the answer to one user message of the conversation held under `session_id`.

        By default the message continues the session (append mode: the server prepends its history; a
        session it holds nothing for is NOT_FOUND). `new=True` starts the conversation (with `system`, if
        given), replacing whatever the session held. Other options as for generate.
        """
        request = chat_request(message, session_id=session_id, new=new, system=system, **options)
        return self.generate(request, timeout=timeout)

    def conversation(
        self, session_id: str | None = None, *, system: str | None = None, resume: bool = False, **options: Any
    ) -> Conversation:
        """A Conversation under `session_id` (a new random one when None); see llmserve_client.conversation."""
        return Conversation(self, session_id, system=system, resume=resume, **options)

    def tokenize(
        self, text: str | None = None, *, messages: Iterable[Message] | None = None, timeout: Any = _DEFAULT
    ) -> list[int]:
        """The token ids Generate would feed the model for this text or conversation."""
        response = self._unary(self._stub.Tokenize, tokenize_request(text, messages=messages), timeout)
        return list(response.token_ids)

    def embed(
        self, inputs: str | Iterable[EmbedItem] | pb.EmbedRequest, *, timeout: Any = _DEFAULT, **options: Any
    ) -> pb.EmbedResponse:
        """The vectors of one text or a batch of inputs (see embed_request for the inputs and options: normalize,
        dimensions, truncate, pooling, request_id, priority), or of a ready EmbedRequest: one Embedding per input,
        in input order (`response.embeddings[i].values`), and the usage."""
        request = inputs if isinstance(inputs, pb.EmbedRequest) else embed_request(inputs, **options)
        response: pb.EmbedResponse = self._unary(self._stub.Embed, request, timeout)
        return response

    def rerank(
        self, query: str | pb.RerankRequest, documents: Iterable[str] = (), *, timeout: Any = _DEFAULT, **options: Any
    ) -> pb.RerankResponse:
        """The documents' scores against `query` by a cross-encoder (options: RerankRequest's fields top_n,
        return_documents, input_order, request_id, priority), or those of a ready RerankRequest: results best first
        (`response.results[0].index` is the best document's position)."""
        request = (
            query
            if isinstance(query, pb.RerankRequest)
            else pb.RerankRequest(query=query, documents=documents, **options)
        )
        response: pb.RerankResponse = self._unary(self._stub.Rerank, request, timeout)
        return response

    def model_info(self, *, timeout: Any = _DEFAULT) -> pb.GetModelInfoResponse:
        response: pb.GetModelInfoResponse = self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return response

    def health(self, service: str = "", *, timeout: Any = _DEFAULT) -> str:
        """The grpc.health.v1 status of the server ("") or a service: "SERVING", "NOT_SERVING", ..."""
        response = self._health_check(health.HealthCheckRequest(service=service), timeout=self._timeout(timeout))
        return health.status_name(response)

    def get_session(self, session_id: str, *, timeout: Any = _DEFAULT) -> pb.GetSessionResponse | None:
        """What the server caches for a session, or None when it caches nothing."""
        try:
            request = pb.GetSessionRequest(session_id=session_id)
            response: pb.GetSessionResponse = self._unary(
                self._stub.GetSession, request, timeout, session_metadata(session_id)
            )
            return response
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def delete_session(self, session_id: str, *, timeout: Any = _DEFAULT) -> bool:
        """Free a session's cache; True when there was one."""
        request = pb.DeleteSessionRequest(session_id=session_id)
        metadata = session_metadata(session_id)
        response: pb.DeleteSessionResponse = self._stub.DeleteSession(
            request, timeout=self._timeout(timeout), metadata=metadata
        )
        return response.deleted

    def load_adapter(self, name: str, path: str, *, timeout: Any = _DEFAULT) -> adapters_pb2.AdapterInfo:
        """Have the server read the PEFT adapter folder `path` (on the server) and serve it as `name`."""
        request = adapters_pb2.LoadAdapterRequest(name=name, path=path)
        response: adapters_pb2.LoadAdapterResponse = self._adapters.LoadAdapter(request, timeout=self._timeout(timeout))
        return response.adapter

    def unload_adapter(self, name: str, *, timeout: Any = _DEFAULT) -> int:
        """Unload an adapter; returns how many requests still use it (they finish on it)."""
        request = adapters_pb2.UnloadAdapterRequest(name=name)
        response: adapters_pb2.UnloadAdapterResponse = self._adapters.UnloadAdapter(
            request, timeout=self._timeout(timeout)
        )
        return response.draining_requests

    def list_adapters(self, *, timeout: Any = _DEFAULT) -> adapters_pb2.ListAdaptersResponse:
        """The loaded adapters and the server's LoRA limits."""
        response: adapters_pb2.ListAdaptersResponse = self._unary(
            self._adapters.ListAdapters, adapters_pb2.ListAdaptersRequest(), timeout
        )
        return response

    def _unary(self, method: Callable[..., T], request: Any, timeout: Any, metadata: Metadata = ()) -> T:
        """An idempotent unary call, retried as `self.retry` says."""
        attempts = Attempts(self.retry, self._timeout(timeout))
        while True:
            try:
                return method(request, timeout=attempts.start(), metadata=metadata)
            except grpc.RpcError as error:
                delay = attempts.retry_after(error)
                if delay is None:
                    raise
            time.sleep(delay)
