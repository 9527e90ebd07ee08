"""Two real llmserve replicas (`python -m llmserve`) behind the real smg gateway: a conversation's next turn lands on
the replica that holds its prefix (cache_aware) and reuses its KV there; `consistent_hashing` on X-SMG-Routing-Key
keeps a session's turns on one replica; a stopped replica's traffic moves to the other, every stream completed or
failed with a status, none hung."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llmserve_client import Client
from tests.deploy.replicas import Replica
from tests.deploy.smg import Smg, smg_binary

pytestmark = pytest.mark.skipif(smg_binary() is None, reason="smg (the gateway extra) is not installed")

# A long shared system prompt, so that the first turn's prompt is most of the second's.
SYSTEM = "You are a careful assistant. " * 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.service.harness import tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama-smollm2-tokenizer")
    loaded = tiny_model()
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def replicas(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("logs")
    nodes = [Replica(name, logs, model=str(model_dir)) for name in ("a", "b")]
    try:
        for node in nodes:
            node.wait_serving()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def served(replica: Replica) -> float:
    """Generate calls the replica has ended, whatever their status."""
    return sum(
        float(line.split()[-1])
        for line in replica.metrics().splitlines()
        if line.startswith("llmserve_requests_total{")
    )


def sdk(smg: Smg) -> openai.OpenAI:
    return openai.OpenAI(base_url=smg.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_next_turn_goes_where_its_prefix_is_cached(
    replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> None:
    smg = Smg([r.address for r in replicas], tmp_path_factory.mktemp("smg") / "smg.log", policy="cache_aware")
    try:
        model, client = smg.wait_ready(), sdk(smg)
        for conversation in range(4):
            messages = [
                {"role": "system", "content": f"{conversation}: {SYSTEM}"},
                {"role": "user", "content": "Say something."},
            ]
            before = [served(r) for r in replicas]
            first = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8)
            after = [served(r) for r in replicas]
            (holder,) = [i for i in range(2) if after[i] > before[i]]
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And more."},
            ]
            second = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8)
            later = [served(r) for r in replicas]
            assert later[holder] == after[holder] + 1 and later[1 - holder] == after[1 - holder]
            usage = second.usage
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
    finally:
        smg.stop()


def test_cache_aware_routes_on_the_replicas_kv_events(
    replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A prefix computed on a replica behind smg's back (llmserve's own Generate, not through smg) is known to smg
    only from that replica's KV events: a chat through smg that extends it still goes there, each time."""
    smg = Smg([r.address for r in replicas], tmp_path_factory.mktemp("smg") / "smg.log", policy="cache_aware")
    try:
        model, client = smg.wait_ready(), sdk(smg)
        for conversation in range(6):
            holder = conversation % 2
            messages = [
                {"role": "system", "content": f"warm {conversation}: {SYSTEM}"},
                {"role": "user", "content": "Say something."},
            ]
            with Client(replicas[holder].address, timeout=60) as own:
                own.generate_text(messages=messages, max_new_tokens=1)
            time.sleep(0.3)  # the events' poll (50 ms) and smg's stream
            before = [served(r) for r in replicas]
            response = client.chat.completions.create(
                model=model, messages=[*messages, {"role": "user", "content": "More."}], temperature=0, max_tokens=2
            )
            after = [served(r) for r in replicas]
            assert after[holder] == before[holder] + 1, (conversation, before, after)
            usage = response.usage
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
        assert "KV event stream connected" in smg.log_path.read_text()
    finally:
        smg.stop()


def test_consistent_hashing_keeps_a_sessions_turns_on_one_replica(
    replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> None:
    smg = Smg([r.address for r in replicas], tmp_path_factory.mktemp("smg") / "smg.log", policy="consistent_hashing")
    try:
        model, client = smg.wait_ready(), sdk(smg)
        homes: dict[str, set[int]] = {}
        for turn in range(3):
            for session in range(6):
                key = f"session-{session}"
                before = [served(r) for r in replicas]
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"turn {turn} of {key}"}],
                    max_tokens=2,
                    extra_headers={"X-SMG-Routing-Key": key},
                )
                after = [served(r) for r in replicas]
                homes.setdefault(key, set()).update(i for i in range(2) if after[i] > before[i])
        assert all(len(home) == 1 for home in homes.values()), homes
        assert {i for home in homes.values() for i in home} == {0, 1}, "six sessions spread over both replicas"
    finally:
        smg.stop()


def test_a_stopped_replicas_traffic_moves_and_no_stream_hangs(
    replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Last in the module: it stops replica b."""
    smg = Smg(
        [r.address for r in replicas],
        tmp_path_factory.mktemp("smg") / "smg.log",
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        policy="round_robin",
    )
    outcomes: list[str] = []
    try:
        model, client = smg.wait_ready(), sdk(smg)

        def stream(i: int) -> None:
            try:
                events = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"stream {i}"}],
                    max_tokens=200,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                finish = [c.finish_reason for e in events for c in e.choices if c.finish_reason]
                outcomes.append(f"completed:{finish}")
            except openai.APIError as err:  # a status, not a hang
                outcomes.append(f"failed:{type(err).__name__}")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        replicas[1].stop()  # SIGTERM: it drains its streams (grace period), then exits
        for thread in threads:
            thread.join(timeout=90)
        assert not any(thread.is_alive() for thread in threads), "a stream hung"
        assert len(outcomes) == 8 and all(o.startswith(("completed", "failed")) for o in outcomes), outcomes
        before = served(replicas[0])
        for i in range(6):
            response = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"after {i}"}], max_tokens=2
            )
            assert response.choices[0].message.content is not None
        assert served(replicas[0]) == before + 6
    finally:
        smg.stop()
