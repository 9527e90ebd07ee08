"""With authentication on, sessions, request ids and the prefix cache belong to their caller, and one caller's
streams cannot take every slot."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from harness import ServerThread, tiny_engine, wait_until

from llmserve_client import Client

ALICE, BOB = "token-alice", "token-bob"
PROMPT = list(range(300, 400))  # 100 tokens: six full 16-token blocks to cache


def _start(tmp_path: Path, **config: object) -> ServerThread:
    tokens = tmp_path / "tokens.csv"
    tokens.write_text(f"{ALICE},alice\n{BOB},bob\n")
    # What is scoped per identity is the edge's and the books' (keys and salts): a core on a thread serves it alike.
    return ServerThread(tiny_engine(in_process=True), auth_token_file=str(tokens), **config).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    srv = _start(tmp_path_factory.mktemp("scoping"))
    yield srv
    srv.stop()


def _clients(srv: ServerThread) -> tuple[Client, Client]:
    return Client(srv.address, timeout=60, token=ALICE), Client(srv.address, timeout=60, token=BOB)


def _usage(client: Client, ids: list[int], **options: object):  # noqa: ANN202 - pb.Usage
    return list(client.generate(token_ids=ids, max_new_tokens=4, ignore_eos=True, **options))[-1].usage


def test_a_session_id_names_one_session_per_identity(server: ServerThread) -> None:
    alice, bob = _clients(server)
    with alice, bob:
        _usage(alice, PROMPT, session_id="conv")
        assert alice.get_session("conv").cached_tokens > 0

        # Bob's "conv" does not exist: the very answer an id that never existed gets.
        with pytest.raises(grpc.RpcError) as theirs:
            bob._stub.GetSession(_get("conv"), timeout=10)
        with pytest.raises(grpc.RpcError) as never:
            alice._stub.GetSession(_get("conv2"), timeout=10)
        assert theirs.value.code() == never.value.code() == grpc.StatusCode.NOT_FOUND
        assert theirs.value.details() == never.value.details().replace("conv2", "conv")
        assert bob.delete_session("conv") is False
        assert alice.get_session("conv") is not None, "Bob's delete did not touch Alice's session"

        # Bob continuing "conv" with Alice's very tokens reuses nothing of hers (neither session nor prefix).
        assert _usage(bob, PROMPT + [7, 8], session_id="conv").cached_prompt_tokens == 0
        assert _usage(alice, PROMPT + [7, 8], session_id="conv").cached_prompt_tokens >= 96
        assert bob.get_session("conv").cached_tokens > 0  # now Bob has his own
        assert alice.delete_session("conv") and bob.delete_session("conv")


def _get(session_id: str):  # noqa: ANN202
    from llmserve_client import pb

    return pb.GetSessionRequest(session_id=session_id)


def test_prefix_cache_is_per_identity_by_default(server: ServerThread) -> None:
    alice, bob = _clients(server)
    prompt = list(range(1000, 1100))
    with alice, bob:
        assert _usage(alice, prompt).cached_prompt_tokens == 0
        assert _usage(alice, prompt).cached_prompt_tokens == 96, "Alice's second call hits her own cache"
        assert _usage(bob, prompt).cached_prompt_tokens == 0, "Bob learns nothing about what Alice sent"


def test_shared_prefix_cache_opts_into_sharing(tmp_path: Path) -> None:
    srv = _start(tmp_path, shared_prefix_cache=True)
    try:
        alice, bob = _clients(srv)
        prompt = list(range(2000, 2100))
        with alice, bob:
            assert _usage(alice, prompt).cached_prompt_tokens == 0
            assert _usage(bob, prompt).cached_prompt_tokens == 96
            # Sessions stay private even so.
            _usage(alice, prompt, session_id="s")
            assert bob.get_session("s") is None
    finally:
        srv.stop()


def test_request_ids_are_per_identity(server: ServerThread) -> None:
    alice, bob = _clients(server)
    with alice, bob:
        stream = alice.generate("Once upon a time", max_new_tokens=900, ignore_eos=True, request_id="job-1")
        next(stream)
        # The same request id from Bob is his own request, not a duplicate of Alice's.
        assert list(bob.generate("hi", max_new_tokens=2, request_id="job-1"))[-1].request_id == "job-1"
        with pytest.raises(grpc.RpcError) as err:
            list(alice.generate("hi", max_new_tokens=2, request_id="job-1"))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        stream.close()


def test_per_identity_stream_cap(tmp_path: Path) -> None:
    srv = _start(tmp_path, max_streams_per_identity=2)
    try:
        alice, bob = _clients(srv)
        with alice, bob:
            held = [alice.generate("Once upon a time", max_new_tokens=900, ignore_eos=True) for _ in range(2)]
            for stream in held:
                next(stream)
            with pytest.raises(grpc.RpcError) as err:
                list(alice.generate("hi", max_new_tokens=2))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == (
                "2 Generate streams in flight for this caller, the limit (--max-streams-per-identity); retry later"
            )
            assert _retry_delay(err.value) > 0
            # Bob is not Alice: his calls start at once, while both of hers still run.
            started = time.monotonic()
            bob_stream = bob.generate("hi", max_new_tokens=8, ignore_eos=True)
            next(bob_stream)
            assert time.monotonic() - started < 10
            assert list(bob_stream)[-1].usage.completion_tokens == 8
            assert srv.server.servicer.num_streams == 2
            for stream in held:
                stream.close()
            assert wait_until(lambda: srv.server.servicer.num_streams == 0, timeout=10)
            assert alice.generate_text("hi", max_new_tokens=2) is not None
    finally:
        srv.stop()


def _retry_delay(err: grpc.RpcError) -> float:
    status = rpc_status.from_call(err)
    assert status is not None
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToNanoseconds() / 1e9
    raise AssertionError("no RetryInfo")
