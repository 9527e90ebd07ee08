"""Histories in a shared store through gRPC (issue 23): two real servers on one real Redis.

One continuing call per session across servers (the other is ABORTED, the history is never a mix), a turn
committed on one server continued on the other with the output of the full resend, and a Redis lost while
serving: calls with a session id fail UNAVAILABLE naming the store, stateless calls go on, and the metrics
count the failed operations.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from harness import ServerThread, tiny_engine
from redis_server import RedisServer

from llmserve.history import HistoryConfig
from llmserve_client import NO_RETRY, Client, build_request

OPTIONS = dict(ignore_eos=True, return_token_ids=True, return_prompt_token_ids=True)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    srv = RedisServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pair(redis_server: RedisServer) -> Iterator[tuple[ServerThread, ServerThread]]:
    """Two servers (two engines over one tiny model's weights) sharing one Redis, like two replicas."""
    history = HistoryConfig(store=redis_server.url, lease_s=5.0)
    # Two replicas over one store: what they share is the store; their cores run on threads (starting in a tenth of
    # an engine process's time).
    a = ServerThread(tiny_engine(in_process=True), history=history, metrics=True).start()
    b = ServerThread(tiny_engine(in_process=True), history=history).start()
    yield a, b
    a.stop()
    b.stop()


def _run(client: Client, **request: object) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of one call."""
    responses = list(client.generate(**request))
    return list(responses[0].prompt_token_ids), [t for r in responses for t in r.token_ids]


def _status(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        list(call)  # type: ignore[call-overload]
    return err.value.code(), err.value.details()


def test_a_turn_committed_on_one_server_is_continued_on_the_other(pair: tuple[ServerThread, ServerThread]) -> None:
    a, b = pair
    with Client(a.address, timeout=60, retry=NO_RETRY) as ca, Client(b.address, timeout=60, retry=NO_RETRY) as cb:
        held: list[int] = []
        for i, client in enumerate([ca, cb, ca, cb]):
            new = [300 + 11 * i + k for k in range(4)]
            prompt, ids = _run(
                client, token_ids=new, session_id="hop", continue_session=i > 0, max_new_tokens=5, **OPTIONS
            )
            assert prompt == held + new
            _, full = _run(ca if client is cb else cb, token_ids=prompt, max_new_tokens=5, **OPTIONS)
            assert ids == full, i
            held = prompt + ids
        info = ca.get_session("hop")
        assert (info.history_turns, info.history_tokens) == (4, len(held))
        assert cb.delete_session("hop")
        code, message = _status(ca.generate(token_ids=[1], session_id="hop", continue_session=True))
        assert code == grpc.StatusCode.NOT_FOUND and "deleted" in message


def test_two_continuations_at_once_on_two_servers_one_proceeds_never_a_mix(
    pair: tuple[ServerThread, ServerThread],
) -> None:
    a, b = pair
    with Client(a.address, timeout=60, retry=NO_RETRY) as ca, Client(b.address, timeout=60, retry=NO_RETRY) as cb:
        _, ids = _run(ca, token_ids=[5, 6, 7], session_id="race", max_new_tokens=2, **OPTIONS)
        held = [5, 6, 7, *ids]
        aborted = 0
        for i in range(12):
            outcomes: dict[str, object] = {}
            go = threading.Barrier(2)

            def call(
                name: str, client: Client, mark: int, go: threading.Barrier = go, outcomes: dict[str, object] = outcomes
            ) -> None:
                go.wait()
                try:
                    outcomes[name] = _run(
                        client, token_ids=[mark], session_id="race", continue_session=True, max_new_tokens=24, **OPTIONS
                    )
                except grpc.RpcError as exc:
                    outcomes[name] = exc

            threads = [
                threading.Thread(target=call, args=("a", ca, 1000 + i)),
                threading.Thread(target=call, args=("b", cb, 2000 + i)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            errors = [o for o in outcomes.values() if isinstance(o, grpc.RpcError)]
            assert len(errors) <= 1, errors
            for error in errors:
                assert error.code() == grpc.StatusCode.ABORTED, error
                assert "is being continued by request" in error.details()
            aborted += len(errors)
            done = sorted((o for o in outcomes.values() if not isinstance(o, grpc.RpcError)), key=lambda o: len(o[0]))
            # Each call that proceeded read the whole history before it (the one ahead of it included, when the
            # two ran one after the other): never a mix, never a lost turn.
            for prompt, ids in done:  # type: ignore[misc]
                assert prompt[:-1] == held and prompt[-1] in (1000 + i, 2000 + i), (i, len(prompt), len(held))
                held = prompt + ids
            assert ca.get_session("race").history_tokens == len(held)
        assert aborted > 0, "the two calls never overlapped: the test did not test the lease"
        prompt, _ = _run(cb, token_ids=[7], session_id="race", continue_session=True, max_new_tokens=1, **OPTIONS)
        assert prompt == [*held, 7]


def test_a_lost_redis_fails_session_calls_unavailable_and_stateless_calls_go_on(
    pair: tuple[ServerThread, ServerThread], redis_server: RedisServer
) -> None:
    a, _ = pair
    with Client(a.address, timeout=60, retry=NO_RETRY) as c:
        _run(c, token_ids=[9, 9], session_id="lost", max_new_tokens=2, **OPTIONS)
        redis_server.stop()
        try:
            for request in (
                build_request(token_ids=[1], session_id="lost", continue_session=True),
                build_request(token_ids=[1], session_id="lost"),
            ):
                code, message = _status(c.generate(request))
                assert code == grpc.StatusCode.UNAVAILABLE, message
                assert f"the session history store {redis_server.url} is unavailable" in message
            with pytest.raises(grpc.RpcError) as err:
                c.get_session("lost")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert c.generate_text(token_ids=[1, 2, 3], max_new_tokens=3) is not None, "a stateless call is served"
            assert c.health() == "SERVING"
            metrics = _scrape(a)
            assert 'llmserve_history_store_errors_total{operation="start",store="redis"}' in metrics
            assert _sample(metrics, 'llmserve_history_store_errors_total{operation="start",store="redis"}') >= 2
        finally:
            redis_server.start()
        # The restarted Redis kept nothing (no persistence): the session is gone, a new one works at once.
        code, _ = _status(c.generate(token_ids=[1], session_id="lost", continue_session=True))
        assert code == grpc.StatusCode.NOT_FOUND
        _run(c, token_ids=[9, 9], session_id="lost", max_new_tokens=2, **OPTIONS)
        _run(c, token_ids=[4], session_id="lost", continue_session=True, max_new_tokens=2, **OPTIONS)
        metrics = _scrape(a)
        assert _sample(metrics, 'llmserve_history_store_operation_seconds_count{operation="commit",store="redis"}') > 0


def _scrape(server: ServerThread) -> str:
    port = server.config.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text: str = response.read().decode()
        return text


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
