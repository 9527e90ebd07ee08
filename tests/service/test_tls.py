"""TLS and mutual TLS between llmserve_client and the server, with throw-away certificates from openssl."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_engine import FakeEngine
from harness import ServerThread

from llmserve_client import TLS, Client

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("certs")
    server_cert, server_key = _self_signed(folder, "server")
    client_cert, client_key = _self_signed(folder, "client")
    return {"server_cert": server_cert, "server_key": server_key, "client_cert": client_cert, "client_key": client_key}


def _server(**config: object) -> Iterator[ServerThread]:
    srv = ServerThread(FakeEngine(), **config).start()
    yield srv
    srv.stop()


@pytest.fixture
def tls_server(certs: dict[str, Path]) -> Iterator[ServerThread]:
    yield from _server(tls_cert=str(certs["server_cert"]), tls_key=str(certs["server_key"]))


@pytest.fixture
def mtls_server(certs: dict[str, Path]) -> Iterator[ServerThread]:
    yield from _server(
        tls_cert=str(certs["server_cert"]), tls_key=str(certs["server_key"]), tls_client_ca=str(certs["client_cert"])
    )


def _localhost(srv: ServerThread) -> str:
    return f"localhost:{srv.server.port}"  # the name in the certificate


def test_tls(tls_server: ServerThread, certs: dict[str, Path]) -> None:
    with Client(_localhost(tls_server), timeout=10, tls=TLS.from_files(ca=certs["server_cert"])) as client:
        assert client.health() == "SERVING"
        assert client.generate_text("hi", max_new_tokens=3)
    with Client(_localhost(tls_server), timeout=2) as plaintext, pytest.raises(grpc.RpcError):
        plaintext.health()


def test_mutual_tls(mtls_server: ServerThread, certs: dict[str, Path]) -> None:
    tls = TLS.from_files(ca=certs["server_cert"], cert=certs["client_cert"], key=certs["client_key"])
    with Client(_localhost(mtls_server), timeout=10, tls=tls) as client:
        assert client.health() == "SERVING"
    anonymous = TLS.from_files(ca=certs["server_cert"])
    with Client(_localhost(mtls_server), timeout=2, tls=anonymous) as client, pytest.raises(grpc.RpcError):
        client.health()
