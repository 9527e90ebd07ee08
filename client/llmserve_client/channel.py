"""Channel options shared by the sync and async clients: plaintext or TLS (optionally mutual)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from llmserve_client.auth import BearerToken, aio_interceptors


@dataclass(slots=True, frozen=True)
class TLS:
    """TLS settings. No root certificates: the system's. A private key and certificate chain: mutual TLS."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    @classmethod
    def from_files(
        cls, ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
    ) -> TLS:
        """Read PEM files: `ca` to verify the server, `cert` and `key` to identify this client."""
        if (cert is None) != (key is None):
            raise ValueError("a client certificate needs its key, and the other way round")

        def read(path: str | Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(read(ca), read(key), read(cert))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def open_channel(
    target: str, tls: TLS | bool | None, options: Sequence[tuple[str, Any]], *, aio: bool, token: str | None = None
) -> Any:
    """A grpc (or grpc.aio) channel: plaintext for tls None/False, the system's roots for True, else `tls`;
    with `token`, every call carries `authorization: Bearer <token>`."""
    if aio:
        interceptors = aio_interceptors(token) if token else None
        if not tls:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        credentials = (tls if isinstance(tls, TLS) else TLS()).credentials()
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
    if not tls:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, (tls if isinstance(tls, TLS) else TLS()).credentials(), options=options)
    return grpc.intercept_channel(channel, BearerToken(token)) if token else channel


# Long streams are normal here: keep idle connections alive through proxies, within what servers allow
# (llmserve accepts a ping every 5 s; gRPC servers by default one per 5 minutes when no data flows). Without
# max_pings_without_data=0 gRPC stops pinging after two pings on a stream that carries no data.
DEFAULT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.http2.max_pings_without_data", 0),
)
