"""Authentication: bearer tokens from a Kubernetes static token file, client certificates as identities, and
every method reflection lists called with no token, a wrong token and a good one."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_engine import FakeEngine
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from harness import ServerThread

from llmserve.auth import UNAUTHENTICATED_MESSAGE, TokenFileError, TokenStore, bearer_token, parse_token_file
from llmserve_client import TLS, Client

GOOD, WRONG = "s3cret-token-of-alice", "s3cret-token-of-mallory"
TOKENS = f"""{GOOD},alice,1001,"group1,group2"
# a comment line, then a blank one

other-token,bob
"""


# -- the token file ----------------------------------------------------------------------------------------------


def test_token_file_is_kubernetes_static_token_format(tmp_path: Path) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text(TOKENS)
    store = TokenStore(path)
    assert len(store) == 2
    assert store.identify(GOOD) == "alice"  # further columns (uid, quoted groups) ignored
    assert store.identify("other-token") == "bob"
    assert store.identify(WRONG) is None
    assert store.identify("") is None
    assert store.identify(GOOD[:-1]) is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "no tokens"),
        ("just-a-token\n", "line 1: expected token,identity"),
        ("tok,alice\n,bob\n", "line 2: expected token,identity"),
        ("tok,alice\ntok,bob\n", "line 2: the token of line 1 again"),
    ],
)
def test_bad_token_files_are_refused_without_quoting_tokens(text: str, error: str) -> None:
    with pytest.raises(TokenFileError, match=error) as err:
        parse_token_file(text)
    assert "tok," not in str(err.value)


def test_bearer_metadata() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("x-other", "1"), ("authorization", "bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token([]) is None and bearer_token(None) is None


# -- every method, three ways -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens.csv"
    path.write_text(TOKENS)
    return path


def _server(**config: object) -> Iterator[ServerThread]:
    srv = ServerThread(FakeEngine(), **config).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def auth_server(token_file: Path) -> Iterator[ServerThread]:
    yield from _server(auth_token_file=str(token_file))


@pytest.fixture(scope="module")
def strict_server(token_file: Path) -> Iterator[ServerThread]:
    yield from _server(auth_token_file=str(token_file), reflection_requires_auth=True)


def _metadata(token: str | None) -> list[tuple[str, str]]:
    return [] if token is None else [("authorization", f"Bearer {token}")]


def _methods(channel: grpc.Channel, token: str | None) -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method of every service reflection lists."""
    database = ProtoReflectionDescriptorDatabase(channel)
    if token is not None:  # the descriptor database has no metadata option: reach past it for this one call
        stub = database._stub
        real = stub.ServerReflectionInfo
        stub.ServerReflectionInfo = lambda requests: real(requests, metadata=_metadata(token))
    pool = descriptor_pool.DescriptorPool(database)
    out = []
    for name in database.get_services():
        for method in pool.FindServiceByName(name).methods:
            out.append((f"/{name}/{method.name}", method.client_streaming, method.server_streaming))
    return out


def _call(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool, token: str | None):
    """The status code of one call with an empty request message (the first response for streams)."""
    # SubscribeKvEvents is a live stream that sends nothing until the cache changes: a second is its answer.
    metadata, timeout = _metadata(token), 1 if path.endswith("/SubscribeKvEvents") else 10
    try:
        if client_streaming and server_streaming:
            call = channel.stream_stream(path)(iter([b""]), metadata=metadata, timeout=timeout)
        elif server_streaming:
            call = channel.unary_stream(path)(b"", metadata=metadata, timeout=timeout)
        elif client_streaming:
            channel.stream_unary(path)(iter([b""]), metadata=metadata, timeout=timeout)
            return grpc.StatusCode.OK, ""
        else:
            channel.unary_unary(path)(b"", metadata=metadata, timeout=timeout)
            return grpc.StatusCode.OK, ""
        next(call, None)
        call.cancel()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details()


@pytest.mark.parametrize("strict", [False, True], ids=["reflection-open", "reflection-requires-auth"])
def test_every_method_with_no_token_a_wrong_token_and_a_good_one(
    auth_server: ServerThread, strict_server: ServerThread, strict: bool
) -> None:
    srv = strict_server if strict else auth_server
    with grpc.insecure_channel(srv.address) as channel:
        methods = _methods(channel, GOOD)
        paths = {path for path, _, _ in methods}
        assert {"/llmserve.v1.GenerateService/Generate", "/grpc.health.v1.Health/Check"} <= paths
        assert any(path.startswith("/grpc.reflection.") for path in paths)
        assert len([p for p in paths if p.startswith("/llmserve.v1.GenerateService/")]) == 7
        for path, client_streaming, server_streaming in methods:
            engine_api = path.startswith(("/llmserve.", "/vllm."))  # llmserve's own, and vLLM's engine protocol
            protected = engine_api or (strict and path.startswith("/grpc.reflection."))
            answers = {
                token: _call(channel, path, client_streaming, server_streaming, token) for token in (None, WRONG, GOOD)
            }
            good_code = answers[GOOD][0]
            assert good_code != grpc.StatusCode.UNAUTHENTICATED, (path, answers)
            # UNIMPLEMENTED: the vLLM protocol's FlushCache and profiling, which llmserve does not serve;
            # FAILED_PRECONDITION: its GetTokenizer, for the fake engine's tokenizer (not one transformers can save),
            # Embed (both protocols'), as the fake engine's model has no pooling, and Rerank, as it is no classifier.
            allowed = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)
            allowed += (grpc.StatusCode.FAILED_PRECONDITION,) * path.endswith(("/GetTokenizer", "/Embed", "/Rerank"))
            allowed += (grpc.StatusCode.DEADLINE_EXCEEDED,) * path.endswith("/SubscribeKvEvents")
            # AdapterService: for the --admin-identity identities only (this token's is not one).
            allowed += (grpc.StatusCode.PERMISSION_DENIED,) * path.startswith("/llmserve.v1.AdapterService/")
            assert good_code in allowed, (path, answers)
            for token in (None, WRONG):
                if protected:
                    # The same answer whether the token is missing or wrong: nothing about which tokens exist.
                    assert answers[token] == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE), path
                else:
                    assert answers[token] == answers[GOOD], (path, answers)
    if not strict:
        with grpc.insecure_channel(srv.address) as channel:
            assert _methods(channel, None), "reflection needs no token by default"
    else:
        with grpc.insecure_channel(srv.address) as channel, pytest.raises(grpc.RpcError) as err:
            _methods(channel, None)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_without_auth_no_token_is_needed() -> None:
    for srv in _server():
        with Client(srv.address, timeout=10) as client:
            assert client.generate_text("hi", max_new_tokens=2)


def test_client_library_sends_its_token(auth_server: ServerThread, token_file: Path, tmp_path: Path) -> None:
    with Client(auth_server.address, timeout=10, token=GOOD) as client:
        assert client.health() == "SERVING"
        assert client.generate_text("hi", max_new_tokens=3)
        assert client.tokenize("hi")
        assert client.model_info().name == "fake"
        assert client.get_session("none") is None
        assert client.delete_session("none") is False
    file = tmp_path / "token"
    file.write_text(f"\n{GOOD}\n")
    with Client(auth_server.address, timeout=10, token_file=file) as client:
        assert client.generate_text("hi", max_new_tokens=3)
    with Client(auth_server.address, timeout=10, token=WRONG) as client, pytest.raises(grpc.RpcError) as err:
        client.generate_text("hi", max_new_tokens=3)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_async_client_sends_its_token(auth_server: ServerThread) -> None:
    from llmserve_client import AsyncClient

    async with AsyncClient(auth_server.address, timeout=10, token=GOOD) as client:
        assert await client.generate_text("hi", max_new_tokens=3)
        assert await client.tokenize("hi")
        assert await client.health() == "SERVING"
    async with AsyncClient(auth_server.address, timeout=10) as client:
        with pytest.raises(grpc.RpcError) as err:
            await client.model_info()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- mutual TLS: the client certificate names the caller --------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for localhost, and client certificates: one with a URI SAN, one CN only."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))  # fmt: skip
    for name, subject, san in [
        ("server", "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ("alice", "/CN=alice-cn", "subjectAltName=URI:spiffe://test/alice"),
        ("bob", "/CN=bob", None),
    ]:
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))  # fmt: skip
        ext = d / f"{name}.ext"
        ext.write_text(f"{san}\n" if san else "basicConstraints=CA:FALSE\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                 "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(d / f"{name}.pem"))  # fmt: skip
    return {p.stem + p.suffix.replace(".", "_"): p for p in d.iterdir()}


def test_identity_from_client_certificate(pki: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    config = dict(
        tls_cert=str(pki["server_pem"]),
        tls_key=str(pki["server_key"]),
        tls_client_ca=str(pki["ca_pem"]),
        identity_from_cert=True,
    )
    for srv in _server(**config):
        target = f"localhost:{srv.server.port}"
        identities = {}
        for name in ("alice", "bob"):
            tls = TLS.from_files(ca=pki["ca_pem"], cert=pki[f"{name}_pem"], key=pki[f"{name}_key"])
            with Client(target, timeout=10, tls=tls) as client, caplog.at_level("INFO", "llmserve.requests"):
                caplog.clear()
                client.generate_text("hi", max_new_tokens=2, request_id=f"from-{name}")
                [record] = [r for r in caplog.records if getattr(r, "fields", {}).get("request_id") == f"from-{name}"]
                identities[name] = record.fields["identity"]
        # The first subject alternative name when there is one, else the common name.
        assert identities == {"alice": "spiffe://test/alice", "bob": "bob"}
