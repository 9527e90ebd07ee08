"""Three real replicas behind a real nginx running deploy/nginx/llmserve.conf: session affinity, a replica
stopped (only its sessions move), and a draining replica (no new sessions, its stream in flight finishes).

Replicas serve `random:tiny`, which has no tokenizer: prompts are token ids. A conversation's next prompt is
its previous prompt, the tokens generated for it, and the new turn's tokens, as a chat client would send.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmserve_client import CallInfo, Client, Retry, pb
from tests.deploy.replicas import Nginx, Replica, accepts, needs_nginx, stop_all

SESSIONS = 12
TURNS = 3
NEW_TOKENS = 4
RETRY = Retry(attempts=3, initial_backoff_s=0.05, max_backoff_s=0.5)


@dataclass
class Conversation:
    session_id: str
    rng: random.Random
    tokens: list[int] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)

    def turn(self, client: Client) -> None:
        """Send the next turn; record who served it, what it reused and how many attempts it took."""
        prompt = self.tokens + [self.rng.randrange(3, 1024) for _ in range(self.rng.randrange(5, 20))]
        info = CallInfo()
        responses = list(
            client.generate(
                token_ids=prompt,
                session_id=self.session_id,
                max_new_tokens=NEW_TOKENS,
                ignore_eos=True,
                return_token_ids=True,
                info=info,
            )
        )
        last = responses[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        self.tokens = prompt + [t for r in responses for t in r.token_ids]
        self.replicas.append(info.replica or "?")
        self.cached.append(last.usage.cached_prompt_tokens)
        self.attempts.append(info.attempts)


def conversations(prefix: str, n: int, seed: int) -> list[Conversation]:
    return [Conversation(f"{prefix}-{i}", random.Random(seed * 1000 + i)) for i in range(n)]


def hit_rate(replicas: list[Replica], before: dict[str, tuple[float, float]]) -> float:
    """Session hits / (hits + misses) over `replicas` since `before`, from their metrics."""
    hits = misses = 0.0
    for r in replicas:
        h0, m0 = before[r.name]
        hits += r.counter("llmserve_session_hits_total") - h0
        misses += r.counter("llmserve_session_misses_total") - m0
    return hits / (hits + misses)


def session_counters(replicas: list[Replica]) -> dict[str, tuple[float, float]]:
    return {
        r.name: (r.counter("llmserve_session_hits_total"), r.counter("llmserve_session_misses_total"))
        for r in replicas
        if r.proc.poll() is None
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Replica], Nginx]]:
    binary = needs_nginx()
    folder = tmp_path_factory.mktemp("cluster")
    replicas = [Replica(f"replica-{i}", folder, "--grace-period", "30") for i in range(3)]
    nginx: Nginx | None = None
    try:
        for r in replicas:
            r.wait_serving()
        nginx = Nginx(binary, folder, [r.address for r in replicas])
        checked = nginx.check()
        assert checked.returncode == 0, checked.stderr
        nginx.start()
        yield replicas, nginx
    finally:
        if nginx is not None:
            nginx.stop()
        stop_all(replicas)


def test_the_shipped_config_passes_nginx_t(tmp_path: Path) -> None:
    nginx = Nginx(needs_nginx(), tmp_path, ["10.0.0.11:50051", "10.0.0.12:50051"])
    checked = nginx.check()
    assert checked.returncode == 0, checked.stderr
    assert "test is successful" in checked.stderr


def test_sessions_stick_to_a_replica_and_only_a_stopped_replicas_sessions_move(
    cluster: tuple[list[Replica], Nginx],
) -> None:
    replicas, nginx = cluster
    by_name = {r.name: r for r in replicas}

    # 1. Through the proxy: every turn of a session on one replica, a hit from its second turn on.
    before = session_counters(replicas)
    convs = conversations("conv", SESSIONS, seed=1)
    with Client(nginx.address, timeout=60, retry=RETRY) as client:
        for _ in range(TURNS):
            for c in convs:
                c.turn(client)
    for c in convs:
        assert len(set(c.replicas)) == 1, (c.session_id, c.replicas)
        assert c.cached[0] == 0 and all(n > 0 for n in c.cached[1:]), (c.session_id, c.cached)
    owners = {c.session_id: c.replicas[0] for c in convs}
    assert len(set(owners.values())) >= 2, f"the sessions spread over the replicas: {owners}"
    proxied_rate = hit_rate(replicas, before)

    # 2. The same workload against one server directly: the same session hit rate.
    solo = replicas[0]
    before = session_counters([solo])
    solo_convs = conversations("solo", SESSIONS, seed=2)
    with Client(solo.address, timeout=60, retry=RETRY) as client:
        for _ in range(TURNS):
            for c in solo_convs:
                c.turn(client)
    solo_rate = hit_rate([solo], before)
    assert proxied_rate == solo_rate == (TURNS - 1) / TURNS

    # 3. Drain the replica that owns the most sessions, with one of its streams in flight.
    counts = {name: list(owners.values()).count(name) for name in by_name}
    victim = by_name[max(counts, key=counts.__getitem__)]
    assert counts[victim.name] < SESSIONS, "some sessions live elsewhere"
    streaming = next(c for c in convs if owners[c.session_id] == victim.name)
    in_flight: list[pb.GenerateResponse] = []
    started = threading.Event()

    def stream() -> None:
        with Client(nginx.address, timeout=120, retry=RETRY) as client:
            request = dict(session_id=streaming.session_id, max_new_tokens=1500, ignore_eos=True, return_token_ids=True)
            for response in client.generate(token_ids=streaming.tokens, **request):
                in_flight.append(response)
                started.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert started.wait(60)
    victim.terminate()
    end = time.monotonic() + 20
    while accepts(victim.port) and time.monotonic() < end:
        time.sleep(0.02)
    assert not accepts(victim.port), "a draining replica closes its listener"
    assert victim.proc.poll() is None, "and stays up while its stream finishes"
    fresh = conversations("fresh", SESSIONS, seed=3)
    with Client(nginx.address, timeout=60, retry=RETRY) as client:
        for c in fresh:
            c.turn(client)
    assert all(c.replicas[0] != victim.name for c in fresh), "no new session lands on the draining replica"
    assert all(c.attempts == [1] for c in fresh), "nginx skipped it without a client-visible error"
    streamer.join(120)
    assert in_flight[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in in_flight) == in_flight[-1].usage.completion_tokens == 1500
    assert victim.proc.wait(60) == 0

    # 4. After the stop: the victim's sessions move (their next turn is a cold prefill on another replica),
    #    the others stay where their KV is; a retry at most.
    with Client(nginx.address, timeout=60, retry=RETRY) as client:
        for c in convs:
            c.turn(client)
        for c in convs:
            c.turn(client)
    for c in convs:
        before_stop, moved, after = c.replicas[TURNS - 1], c.replicas[TURNS], c.replicas[TURNS + 1]
        assert max(c.attempts) <= 2, (c.session_id, c.attempts)
        if before_stop == victim.name:
            assert moved != victim.name and c.cached[TURNS] == 0, (c.session_id, c.replicas, c.cached)
        else:
            assert moved == before_stop and c.cached[TURNS] > 0, (c.session_id, c.replicas, c.cached)
        assert after == moved and c.cached[TURNS + 1] > 0, "a moved session sticks to its new replica"
