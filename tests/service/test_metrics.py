"""Prometheus metrics of a real server: a known mix of calls, and every counter moves by what the clients saw.

The server runs the real engine over the tiny model with `--metrics-port`; the test scrapes /metrics over
HTTP between phases and compares differences with what its own calls received.
"""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from harness import ServerThread, tiny_engine, wait_until
from prometheus_client.parser import text_string_to_metric_families

from llmserve_client import build_request, pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

MAX_STREAMS = 2
LONG = 960  # new tokens (prompts stay under 64; the context is 1024): streams that outlive the test's hold


@pytest.fixture(scope="module")
def metered() -> Iterator[tuple[ServerThread, int]]:
    srv = ServerThread(tiny_engine(), metrics=True, max_concurrent_streams=MAX_STREAMS).start()
    yield srv, srv.metrics_port
    srv.stop()


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape(port: int) -> dict[str, float]:
    """Samples as {'name' or 'name{k="v"}': value}."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape_text(port)):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "le")
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            if "le" not in sample.labels:
                out[key] = sample.value
    return out


class Diff:
    """Metric differences between two scrapes (missing samples count as 0)."""

    def __init__(self, before: dict[str, float], after: dict[str, float]) -> None:
        self.before, self.after = before, after

    def __call__(self, key: str) -> float:
        return self.after.get(key, 0.0) - self.before.get(key, 0.0)


def settle(port: int, before: dict[str, float], calls: int) -> dict[str, float]:
    """Scrape until `calls` more Generate calls have been counted (observers run as each handler ends)."""

    def total(s: dict[str, float]) -> float:
        return sum(v for k, v in s.items() if k.startswith("llmserve_requests_total{"))

    end = time.monotonic() + 30
    while True:
        now = scrape(port)
        if total(now) - total(before) >= calls or time.monotonic() > end:
            assert total(now) - total(before) == calls, "Generate calls counted"
            return now
        time.sleep(0.05)


def prompt(rng: random.Random, n: int) -> list[int]:
    # Ids above the tokenizer's specials, distinct per call: no prefix-cache reuse between calls.
    return [rng.randrange(1000, 49000) for _ in range(n)]


def test_counters_and_histograms_follow_what_the_clients_saw(metered: tuple[ServerThread, int]) -> None:
    srv, port = metered
    rng = random.Random(14)
    with grpc.insecure_channel(srv.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        # Phase 1: calls that complete, two of them the turns of one session (a miss, then a hit).
        s0 = scrape(port)
        seen: list[list[pb.GenerateResponse]] = []
        prompts = [prompt(rng, 40), prompt(rng, 23)]
        for ids in prompts:
            request = build_request(token_ids=ids, max_new_tokens=5, ignore_eos=True, return_token_ids=True)
            seen.append(list(stub.Generate(request, timeout=60)))
        turn1 = prompt(rng, 37)
        session = dict(session_id="secret-session", ignore_eos=True, return_token_ids=True)
        request = build_request(token_ids=turn1, request_id="secret-request", max_new_tokens=6, **session)
        seen.append(list(stub.Generate(request, timeout=60)))
        turn2 = turn1 + [t for r in seen[-1] for t in r.token_ids] + prompt(rng, 9)
        seen.append(list(stub.Generate(build_request(token_ids=turn2, max_new_tokens=4, **session), timeout=60)))
        s1 = settle(port, s0, calls=4)
        d = Diff(s0, s1)
        finals = [responses[-1] for responses in seen]
        assert all(f.finish_reason == pb.FINISH_REASON_LENGTH for f in finals)
        assert finals[3].usage.cached_prompt_tokens > 0 and finals[2].usage.cached_prompt_tokens == 0
        with_tokens = [sum(1 for r in responses if r.token_ids) for responses in seen]

        assert d('llmserve_requests_total{code="OK"}') == 4
        assert d('llmserve_requests_finished_total{finish_reason="length"}') == 4
        assert (
            d("llmserve_prompt_tokens_total") == sum(f.usage.prompt_tokens for f in finals) == 40 + 23 + 37 + len(turn2)
        )
        assert d("llmserve_cached_prompt_tokens_total") == sum(f.usage.cached_prompt_tokens for f in finals)
        assert d("llmserve_generated_tokens_total") == sum(f.usage.completion_tokens for f in finals) == 5 + 5 + 6 + 4
        assert d("llmserve_session_hits_total") == 1
        assert d("llmserve_session_misses_total") == 1
        assert d("llmserve_prefix_cache_hits_total") == 0
        assert d("llmserve_preemptions_total") == 0
        for name in ("request_duration_seconds", "request_prompt_tokens", "request_completion_tokens"):
            assert d(f"llmserve_{name}_count") == 4, name
        assert d("llmserve_request_completion_tokens_sum") == 20
        assert d("llmserve_time_to_first_token_seconds_count") == 4
        assert d("llmserve_request_queue_duration_seconds_count") == 4
        assert d("llmserve_inter_token_latency_seconds_count") == sum(n - 1 for n in with_tokens)
        assert s1["llmserve_sessions_held"] == 1 and s1["llmserve_sessions_held_blocks"] >= 1

        # Phase 2: the endings that are not a completion.
        s1 = scrape(port)
        # Cancelled mid-stream by its caller.
        long_30 = build_request(token_ids=prompt(rng, 30), max_new_tokens=LONG, ignore_eos=True, return_token_ids=True)
        call = stub.Generate(long_30, timeout=60)
        got_cancelled = [next(call), next(call)]
        call.cancel()
        # Past its deadline.
        deadline_call = stub.Generate(
            build_request(token_ids=prompt(rng, 20), max_new_tokens=LONG, ignore_eos=True, return_token_ids=True),
            timeout=0.5,
        )
        got_deadline: list[pb.GenerateResponse] = []
        with pytest.raises(grpc.RpcError) as err:
            for response in deadline_call:
                got_deadline.append(response)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and got_deadline
        # Invalid: the engine refuses it before taking it.
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(build_request(token_ids=prompt(rng, 10), top_p=0.0), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # At the admission cap: two streams held open, the third refused.
        long_16 = [
            build_request(token_ids=prompt(rng, 16), max_new_tokens=LONG, ignore_eos=True, return_token_ids=True)
            for _ in range(MAX_STREAMS)
        ]
        held = [stub.Generate(request, timeout=60) for request in long_16]
        got_held = [next(h) for h in held]
        during = scrape(port)
        assert during["llmserve_streams_in_flight"] == MAX_STREAMS
        assert during["llmserve_requests_running"] + during["llmserve_requests_waiting"] == MAX_STREAMS
        assert during["llmserve_kv_cache_used_blocks"] > s1["llmserve_sessions_held_blocks"]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(build_request(token_ids=prompt(rng, 10), max_new_tokens=2), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for h in held:
            h.cancel()
        s2 = settle(port, s1, calls=1 + 1 + 1 + MAX_STREAMS + 1)
        assert wait_until(lambda: scrape(port)["llmserve_requests_running"] == 0, timeout=10)
        d = Diff(s1, s2)

        assert d('llmserve_requests_total{code="OK"}') == 0
        assert d('llmserve_requests_total{code="CANCELLED"}') == 1 + MAX_STREAMS
        assert d('llmserve_requests_total{code="DEADLINE_EXCEEDED"}') == 1
        assert d('llmserve_requests_total{code="INVALID_ARGUMENT"}') == 1
        assert d('llmserve_requests_total{code="RESOURCE_EXHAUSTED"}') == 1
        assert d('llmserve_requests_finished_total{finish_reason="cancelled"}') == 1 + MAX_STREAMS
        assert d('llmserve_requests_finished_total{finish_reason="deadline"}') == 1
        assert d('llmserve_requests_finished_total{finish_reason="length"}') == 0
        # The engine took four calls (the refused ones are counted by status only).
        taken = 2 + MAX_STREAMS
        assert d("llmserve_prompt_tokens_total") == 30 + 20 + 16 * MAX_STREAMS
        assert d("llmserve_cached_prompt_tokens_total") == 0
        for name in ("request_duration_seconds", "request_prompt_tokens", "request_completion_tokens"):
            assert d(f"llmserve_{name}_count") == taken, name
        assert d("llmserve_time_to_first_token_seconds_count") == taken  # each got a token before it ended
        # Tokens the server sent but the callers had not read yet when they stopped reading: at least what
        # they read (a deadline's last message may carry none), at most what they asked for.
        read = sum(len(r.token_ids) for r in got_cancelled + got_deadline + got_held)
        assert read <= d("llmserve_generated_tokens_total") <= taken * LONG
        # One gap per message with tokens after a call's first: at most one per token; at least the gaps between
        # the messages the callers read (what they left unread may have gone out as fuller messages).
        gaps_read = sum(max(0, sum(1 for r in got if r.token_ids) - 1) for got in (got_cancelled, got_deadline))
        gaps = d("llmserve_inter_token_latency_seconds_count")
        assert gaps_read <= gaps <= d("llmserve_generated_tokens_total") - taken
        # The engine's queue time arrives with a call's last message, which these callers never read, unless
        # the engine ended the deadline call before gRPC's own timer did.
        assert d("llmserve_request_queue_duration_seconds_count") in (0, 1)
        assert d("llmserve_session_hits_total") == d("llmserve_session_misses_total") == 0

    text = scrape_text(port)
    assert "secret-session" not in text and "secret-request" not in text, "no label takes request values"
    families = [f.name for f in text_string_to_metric_families(text)]
    # vllm: the engine gauges again under the names the inference gateways scrape (test_the_vllm_gauges_...).
    assert all(name.startswith(("llmserve_", "vllm:", "process_", "python_")) for name in families), families
    after = scrape(port)
    assert after["llmserve_engine_alive"] == 1
    assert after["llmserve_kv_cache_capacity_blocks"] == 32768 // 16
    assert after["llmserve_kv_cache_used_blocks"] == after["llmserve_sessions_held_blocks"]
    assert any(k.startswith("llmserve_build_info{") for k in after)
    assert any(k.startswith("llmserve_model_info{") for k in after)


def test_the_vllm_gauges_are_the_engines_under_the_inference_gateways_names(metered: tuple[ServerThread, int]) -> None:
    """vllm:num_requests_running/waiting, vllm:kv_cache_usage_perc (a fraction) and vllm:cache_config_info parse with
    prometheus-client's parser and hold what llmserve's own gauges and the engine's books hold (a stream running)."""
    srv, port = metered
    with grpc.insecure_channel(srv.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        call = stub.Generate(build_request(token_ids=list(range(5, 60)), max_new_tokens=LONG, ignore_eos=True))
        next(call)  # running, holding blocks
        families = {f.name: f for f in text_string_to_metric_families(scrape_text(port))}
        stats = srv.engine.stats()
        call.cancel()

    def value(name: str) -> float:
        (sample,) = families[name].samples
        assert sample.labels == {"model_name": srv.engine.model_info.name}
        return sample.value

    own = {f: families[f].samples[0].value for f in families if f.startswith("llmserve_")}
    assert value("vllm:num_requests_running") == own["llmserve_requests_running"] == stats.running == 1
    assert value("vllm:num_requests_waiting") == own["llmserve_requests_waiting"] == stats.waiting
    usage = value("vllm:kv_cache_usage_perc")
    assert 0 < usage == own["llmserve_kv_cache_used_blocks"] / own["llmserve_kv_cache_capacity_blocks"] <= 1
    assert usage == stats.kv_blocks_used / stats.kv_blocks_total
    (config,) = families["vllm:cache_config_info"].samples
    assert config.value == 1
    assert config.labels == {"block_size": str(stats.block_size), "num_gpu_blocks": str(stats.kv_blocks_total)}


def test_replica_name_is_in_the_trailing_metadata_of_every_call(metered: tuple[ServerThread, int]) -> None:
    srv, _ = metered
    name = srv.server.replica
    assert name.endswith(f":{srv.server.port}")
    with grpc.insecure_channel(srv.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        call = stub.Generate(build_request(token_ids=[1000, 1001, 1002], max_new_tokens=2), timeout=30)
        list(call)
        assert ("x-llmserve-replica", name) in call.trailing_metadata()
        bad = stub.Generate(build_request(token_ids=[1000], top_p=0.0), timeout=30)
        with pytest.raises(grpc.RpcError):
            list(bad)
        assert ("x-llmserve-replica", name) in bad.trailing_metadata()
        _, unary = stub.GetModelInfo.with_call(pb.GetModelInfoRequest(), timeout=30)
        assert ("x-llmserve-replica", name) in unary.trailing_metadata()


def test_a_taken_metrics_port_fails_the_start_and_the_harness_tries_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the metered fixtures once lost: another socket took the port between the pick and the bind."""
    import errno
    import socket

    import tests.testing

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = ServerThread(tiny_engine(in_process=True), metrics_port=port)
        with pytest.raises(OSError) as raised:
            srv.start(serve=False)
        assert raised.value.errno == errno.EADDRINUSE
        srv.stop()
        picks = iter([port])
        fresh = tests.testing.free_port
        monkeypatch.setattr(tests.testing, "free_port", lambda: next(picks, None) or fresh())
        srv = ServerThread(tiny_engine(in_process=True), metrics=True).start(serve=False)
        try:
            assert srv.metrics_port not in (0, port)
            assert "llmserve_" in scrape_text(srv.metrics_port)
        finally:
            srv.stop()


def test_metrics_are_off_by_default() -> None:
    from llmserve.config import ServerConfig, from_args

    assert ServerConfig().metrics_port == 0
    assert from_args(["--metrics-port", "9400"]).server.metrics_port == 9400
    assert from_args([], env={"LLMSERVE_METRICS_PORT": "9401"}).server.metrics_port == 9401


def test_an_embed_call_counts_in_the_embed_series_not_the_generate_ones() -> None:
    from llmserve.telemetry.call import CallRecord
    from llmserve.telemetry.metrics import ServerMetrics

    metrics = ServerMetrics("replica", lambda: 0, lambda: None)
    call = CallRecord("e", time.monotonic(), method="Embed", inputs=3, prompt_tokens=40, status="OK")
    call.queued = call.start
    call.close(has_session=False, metadata=None)
    metrics.call_finished(call)
    sample = metrics.registry.get_sample_value
    assert sample("llmserve_embed_requests_total", {"code": "OK"}) == 1
    assert sample("llmserve_embed_inputs_total") == 3
    assert sample("llmserve_embed_tokens_total") == 40
    assert sample("llmserve_embed_duration_seconds_count") == 1
    assert sample("llmserve_requests_total", {"code": "OK"}) is None
    assert sample("llmserve_prompt_tokens_total") == 0


def test_a_rerank_call_counts_in_its_own_series_not_the_generate_or_embed_ones() -> None:
    from llmserve.telemetry.call import CallRecord
    from llmserve.telemetry.metrics import ServerMetrics

    metrics = ServerMetrics("replica", lambda: 0, lambda: None)
    assert metrics.registry.get_sample_value("llmserve_rerank_requests_total", {"code": "OK"}) == 0  # from the start
    call = CallRecord("r", time.monotonic(), method="Rerank", inputs=3, prompt_tokens=40, status="OK")
    call.queued = call.start
    call.close(has_session=False, metadata=None)
    metrics.call_finished(call)
    sample = metrics.registry.get_sample_value
    assert sample("llmserve_rerank_requests_total", {"code": "OK"}) == 1
    assert sample("llmserve_embed_requests_total", {"code": "OK"}) == 0
    assert sample("llmserve_requests_total", {"code": "OK"}) is None
    assert sample("llmserve_prompt_tokens_total") == 0
