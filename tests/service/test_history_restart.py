"""Held conversations survive the server process (issue 23): `python -m llmserve` killed with SIGKILL and
started again on the same SQLite file, and the store's faults at start.

Token-id conversations on the tiny random model: greedy, so the append-mode turn after a restart must give
exactly the tokens of the full resend of the whole conversation.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from redis_server import RedisServer
from server_process import ServerProcess

from llmserve_client import NO_RETRY, Client

MODEL = ("--model", "random:tiny", "--kv-cache-tokens", "16384", "--log-level", "INFO")
OPTIONS = dict(ignore_eos=True, return_token_ids=True, return_prompt_token_ids=True)


def serve(store: str, *extra: str) -> tuple[ServerProcess, str]:
    proc = ServerProcess(*MODEL, "--history-store", store, *extra)
    port = proc.wait_serving()
    return proc, f"127.0.0.1:{port}"


def turn(client: Client, session: str, new: list[int], *, first: bool, max_new: int = 6) -> tuple[list[int], list[int]]:
    responses = list(
        client.generate(
            token_ids=new, session_id=session, continue_session=not first, max_new_tokens=max_new, **OPTIONS
        )
    )
    return list(responses[0].prompt_token_ids), [t for r in responses for t in r.token_ids]


def full_resend(client: Client, prompt: list[int], max_new: int = 6) -> list[int]:
    return [t for r in client.generate(token_ids=prompt, max_new_tokens=max_new, **OPTIONS) for t in r.token_ids]


def test_a_conversation_survives_kill_9_between_turns(tmp_path: Path) -> None:
    store = f"sqlite:{tmp_path / 'sessions.db'}"
    held: list[int] = []
    for i in range(4):
        proc, address = serve(store)
        try:
            with Client(address, timeout=60, retry=NO_RETRY) as c:
                if i:
                    info = c.get_session("conv")
                    assert (info.history_turns, info.history_tokens) == (i, len(held)), "a committed turn was lost"
                new = [200 + 13 * i + k for k in range(5)]
                prompt, ids = turn(c, "conv", new, first=i == 0)
                assert prompt == held + new
                assert ids == full_resend(c, prompt), i
                held = prompt + ids
        finally:
            proc.kill()  # SIGKILL: no shutdown, no flush


def test_a_kill_during_a_turn_loses_that_turn_only_and_the_retry_succeeds(tmp_path: Path) -> None:
    store = f"sqlite:{tmp_path / 'sessions.db'}"
    proc, address = serve(store, "--history-lease", "1")
    try:
        with Client(address, timeout=60, retry=NO_RETRY) as c:
            prompt, ids = turn(c, "conv", [5, 6, 7], first=True)
            held = prompt + ids
            stream = c.generate(token_ids=[8], session_id="conv", continue_session=True, max_new_tokens=2000, **OPTIONS)
            next(iter(stream))
            proc.kill()
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.kill()
    proc, address = serve(store, "--history-lease", "1")
    try:
        with Client(address, timeout=60, retry=NO_RETRY) as c:
            info = c.get_session("conv")
            assert (info.history_turns, info.history_tokens) == (1, len(held)), "the earlier turn is intact"
            # The killed call's lease lapses after --history-lease: until then a retry is ABORTED, never stuck.
            end = time.monotonic() + 30
            while True:
                try:
                    prompt, ids = turn(c, "conv", [8], first=False)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.ABORTED and time.monotonic() < end, exc
                    time.sleep(0.2)
            assert prompt == [*held, 8]
            assert ids == full_resend(c, prompt)
    finally:
        proc.kill()


def _exit_status(*args: str) -> tuple[int, str]:
    proc = ServerProcess(*MODEL, *args)
    try:
        status = proc.proc.wait(120)
    finally:
        proc.kill()
    time.sleep(0.1)  # the log thread reads the last lines
    return status, "".join(proc.log)


def test_an_unreachable_redis_at_start_exits_2_or_serves_stateless_calls_with_optional() -> None:
    redis = RedisServer()
    url = redis.url
    redis.stop()
    status, log = _exit_status("--history-store", url)
    assert status == 2, log
    assert f"the session history store {url} is unavailable" in log and "exiting with status 2" in log
    proc, address = serve(url, "--history-store-optional")
    try:
        with Client(address, timeout=60, retry=NO_RETRY) as c:
            assert c.health() == "SERVING"
            assert c.generate_text(token_ids=[1, 2, 3], max_new_tokens=2) is not None
            with pytest.raises(grpc.RpcError) as err:
                list(c.generate(token_ids=[1, 2], session_id="s", max_new_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and url in err.value.details()
            redis.start()  # the same port: the server connects on its next call
            try:
                prompt, ids = turn(c, "s", [1, 2], first=True)
                assert turn(c, "s", [3], first=False)[0] == [*prompt, *ids, 3]
            finally:
                redis.stop()
    finally:
        proc.kill()


def test_a_damaged_sqlite_file_is_named_at_start(tmp_path: Path) -> None:
    path = tmp_path / "sessions.db"
    path.write_bytes(b"this is not a database, " * 200)
    status, log = _exit_status("--history-store", f"sqlite:{path}")
    assert status == 2, log
    assert f"sqlite:{path}" in log and "damaged" in log, log
