"""Prometheus metrics on their own HTTP port (`--metrics-port`; 0: off), named `llmserve_*`, and the engine gauges
again under the `vllm:` names the inference gateways read.

Two sources. Each Generate call, when it ends, feeds the histograms and the per-call counters
(`ServerMetrics.call_finished`). The engine's own book-keeping (queue lengths, KV blocks, sessions, and the
counters the scheduler and the session store keep) is read at scrape time by `EngineCollector`, so the step
loop pays nothing for it. No label ever takes a value a request controls: labels are status codes, finish
reasons and eviction causes (fixed sets), and the server's own build and model.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import TYPE_CHECKING

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from llmserve.telemetry.call import CallRecord

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from llmserve.engine.types.protocol import Engine, EngineStats
    from llmserve.engine.types.stats import LoraStats, SpecStats, TierStats
    from llmserve.history import HistoryStore

log = logging.getLogger("llmserve")

PREFIX = "llmserve"
_CODES = frozenset(code.name for code in grpc.StatusCode)
# CPU TTFTs reach minutes under load; a GPU's are milliseconds: the buckets span both.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = tuple(float(2**k) for k in range(18))  # 1 .. 131072


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


class ServerMetrics:
    """The metrics of one server, in a registry of its own (several servers may share a process in tests)."""

    def __init__(
        self,
        replica: str,
        streams_in_flight: Callable[[], int],
        engine: Callable[[], Engine | None],
        history_store: HistoryStore | None = None,
    ) -> None:
        """`engine` says which engine serves now (None while the model loads); `streams_in_flight` how many Generate
        streams are open. Both are read when scraped."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Time from a Generate call's arrival to its first token being sent",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "Time between two consecutive responses with tokens of one Generate call",
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self.e2e = Histogram(
            f"{p}_request_duration_seconds",
            "End-to-end time of Generate calls the engine took (arrival to the last message or the call's end)",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.queue = Histogram(
            f"{p}_request_queue_duration_seconds",
            "Time a request waited in the engine before its first step (reported with the call's last message)",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.prompt_len = Histogram(
            f"{p}_request_prompt_tokens",
            "Prompt length of Generate calls the engine took",
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.completion_len = Histogram(
            f"{p}_request_completion_tokens",
            "Tokens sent per Generate call the engine took",
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.requests = Counter(f"{p}_requests", "Generate calls ended, by gRPC status code", ["code"], registry=r)
        self.finished = Counter(
            f"{p}_requests_finished",
            "Generate calls the engine took, by how generation ended (cancelled/deadline: also the caller's)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of calls the engine took", registry=r)
        self.cached_prompt_tokens = Counter(
            f"{p}_cached_prompt_tokens", "Prompt tokens served from cached KV (sessions or prefix cache)", registry=r
        )
        self.generated_tokens = Counter(f"{p}_generated_tokens", "Tokens sent to callers", registry=r)
        # Embed calls: their own series, so that a pooling call's latency never mixes with a stream's.
        self.embed_requests = Counter(
            f"{p}_embed_requests", "Embed calls ended, by gRPC status code", ["code"], registry=r
        )
        self.embed_requests.labels("OK")  # a series from the start: a scrape before any Embed call reads 0
        self.embed_inputs = Counter(f"{p}_embed_inputs", "Inputs of Embed calls the engine took", registry=r)
        self.embed_tokens = Counter(f"{p}_embed_tokens", "Tokens of Embed calls' inputs the engine read", registry=r)
        self.embed_latency = Histogram(
            f"{p}_embed_duration_seconds",
            "End-to-end time of Embed calls the engine took",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        # Rerank calls: counted apart from Embed's and Generate's (their pairs are pooling requests, as Embed's inputs).
        self.rerank_requests = Counter(
            f"{p}_rerank_requests", "Rerank calls ended, by gRPC status code", ["code"], registry=r
        )
        self.rerank_requests.labels("OK")  # a series from the start, as Embed's
        self.kv_event_batches = Counter(
            f"{p}_kv_event_batches_sent",
            "Prefix-cache event batches handed to SubscribeKvEvents streams (the gateways' view of this cache)",
            registry=r,
        )
        info = Gauge(
            f"{p}_build_info",
            "Always 1; the labels say which build serves and under which replica name",
            ["version", "python_version", "grpc_version", "torch_version", "replica"],
            registry=r,
        )
        info.labels(_version("llmserve"), platform.python_version(), grpc.__version__, _version("torch"), replica).set(
            1
        )
        r.register(EngineCollector(engine, streams_in_flight))
        r.register(HistoryCollector(history_store))
        ProcessCollector(registry=r)  # the standard process_* (CPU, memory, open files) and python_info
        PlatformCollector(registry=r)
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def call_finished(self, call: CallRecord) -> None:
        code = call.code if call.code in _CODES else "UNKNOWN"
        if call.method == "Embed":
            self.embed_requests.labels(code).inc()
            if call.queued is not None:
                self.embed_inputs.inc(call.inputs)
                self.embed_tokens.inc(call.prompt_tokens)
                self.embed_latency.observe(call.end - call.start)
            return
        if call.method == "Rerank":
            self.rerank_requests.labels(code).inc()
            return
        self.requests.labels(code).inc()
        if call.queued is None:
            return  # refused before the engine: a status, nothing else
        if call.finish_reason is not None:
            self.finished.labels(call.finish_reason).inc()
        self.prompt_tokens.inc(call.prompt_tokens)
        self.cached_prompt_tokens.inc(call.cached_prompt_tokens)
        self.generated_tokens.inc(call.completion_tokens)
        self.prompt_len.observe(call.prompt_tokens)
        self.completion_len.observe(call.completion_tokens)
        self.e2e.observe(call.end - call.start)
        if call.queue_s is not None:
            self.queue.observe(call.queue_s)
        times = call.token_times
        if times:
            self.ttft.observe(times[0] - call.start)
            for before, after in zip(times, times[1:], strict=False):
                self.itl.observe(after - before)

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics over HTTP on a thread of its own."""
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class EngineCollector(Collector):
    """Reads the engine's book-keeping when scraped (nothing is counted twice, nothing on the step path)."""

    def __init__(self, engine: Callable[[], Engine | None], streams_in_flight: Callable[[], int]) -> None:
        self._engine = engine
        self._streams = streams_in_flight

    def collect(self) -> Iterator[Metric]:
        p = PREFIX
        engine = self._engine()
        alive = engine is not None and not engine.dead
        yield _gauge(f"{p}_engine_alive", "1 while the engine is loaded and stepping, else 0", int(alive))
        yield _gauge(
            f"{p}_streams_in_flight", "Generate streams open now (--max-concurrent-streams caps them)", self._streams()
        )
        if engine is None:
            return
        info = engine.model_info
        model = GaugeMetricFamily(
            f"{p}_model_info", "Always 1; the labels describe the served model", labels=["model", "dtype", "device"]
        )
        model.add_metric([info.name, info.dtype, info.device], 1)
        yield model
        yield _gauge(f"{p}_model_context_length_tokens", "The served context length", info.context_length)
        pid = engine.engine_pid
        if pid is not None and (rss := _resident_bytes(pid)) is not None:
            # process_resident_memory_bytes is this process's; the weights and the KV cache live in the engine's.
            yield _gauge(f"{p}_engine_process_resident_memory_bytes", "Resident memory of the engine process", rss)
        s = engine.stats()
        yield _gauge(f"{p}_requests_running", "Requests in the running batch", s.running)
        yield _gauge(f"{p}_requests_waiting", "Requests waiting for the engine to take them", s.waiting)
        yield _gauge(f"{p}_kv_cache_capacity_blocks", "KV cache size in blocks", s.kv_blocks_total)
        yield _gauge(f"{p}_kv_cache_used_blocks", "KV blocks held by running requests or sessions", s.kv_blocks_used)
        yield _gauge(
            f"{p}_kv_cache_cached_blocks", "Free KV blocks still holding a reusable prefix", s.kv_blocks_cached
        )
        yield _gauge(f"{p}_kv_cache_block_size_tokens", "Tokens per KV block", s.block_size)
        yield from _vllm_gauges(info.name, s)
        yield _gauge(f"{p}_sessions_held", "Sessions whose KV is cached", s.sessions)
        yield _gauge(f"{p}_sessions_held_blocks", "KV blocks held by cached sessions", s.session_blocks)
        yield _counter(f"{p}_preemptions", "Running requests preempted (KV freed, recomputed later)", s.preemptions)
        yield _counter(f"{p}_session_hits", "Requests with a session id whose session was cached", s.session_hits)
        yield _counter(
            f"{p}_session_misses", "Requests with a session id not cached (new, expired or evicted)", s.session_misses
        )
        evictions = CounterMetricFamily(
            f"{p}_session_evictions",
            "Sessions dropped by the server: memory (KV needed), limit (count or pool share), ttl (idle)",
            labels=["reason"],
        )
        for reason, n in sorted(s.session_evictions.items()):
            evictions.add_metric([reason], n)
        yield evictions
        yield _counter(
            f"{p}_prefix_cache_hits",
            "Requests without a cached session that reused prefix-cached KV",
            s.prefix_cache_hits,
        )
        if s.kv_tiers is not None:
            yield from _tier_metrics(s.kv_tiers)
        if s.lora is not None:
            yield from _lora_metrics(s.lora)
        if s.speculation is not None:
            yield from _spec_metrics(s.speculation)


def _vllm_gauges(model: str, s: EngineStats) -> Iterator[Metric]:
    """The same gauges under the names of the inference gateways' model-server protocol (gateway-api-inference-
    extension, proposal 003: what their endpoint pickers scrape from vLLM), labelled by model as vLLM's are."""
    usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
    for name, doc, value in (
        ("vllm:num_requests_running", "Requests in the running batch (llmserve_requests_running)", s.running),
        ("vllm:num_requests_waiting", "Requests waiting for the engine (llmserve_requests_waiting)", s.waiting),
        ("vllm:kv_cache_usage_perc", "Share of the KV cache's blocks in use, 0 to 1 (1 = 100%)", usage),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
        gauge.add_metric([model], value)
        yield gauge
    config = GaugeMetricFamily(
        "vllm:cache_config_info", "Always 1; the labels describe the KV cache", labels=["block_size", "num_gpu_blocks"]
    )
    config.add_metric([str(s.block_size), str(s.kv_blocks_total)], 1)
    yield config


def _lora_metrics(lora: LoraStats) -> Iterator[Metric]:
    """The LoRA adapters: the model-server protocol's info gauge (vLLM's `vllm:lora_requests_info`, which the
    inference gateways' endpoint pickers read to route by adapter) under our name and vLLM's, and our counts."""
    p = PREFIX
    labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
    values = [str(lora.max_loras), ",".join(lora.running), ",".join(lora.waiting)]
    for name in (f"{p}_lora_requests_info", "vllm:lora_requests_info"):
        info = GaugeMetricFamily(
            name,
            "The adapters with running and with only waiting requests; value: unix time they last changed",
            labels=labels,
        )
        info.add_metric(values, lora.changed)
        yield info
    yield _gauge(f"{p}_lora_adapters_registered", "LoRA adapters a request may name", lora.registered)
    yield _gauge(
        f"{p}_lora_adapters_resident", "LoRA adapters in host memory (--max-cpu-loras caps them)", lora.resident
    )
    requests = CounterMetricFamily(f"{p}_lora_requests", "Requests the engine took per adapter", labels=["adapter"])
    for adapter, n in lora.requests:
        requests.add_metric([adapter], n)
    yield requests
    yield _counter(f"{p}_lora_slot_writes", "LoRA adapters copied into a device slot before a step", lora.slot_writes)
    yield _counter(
        f"{p}_lora_adapter_reads",
        "LoRA adapter folders read (loads, and re-reads after an unload to make room)",
        lora.reads,
    )


def _resident_bytes(pid: int) -> int | None:
    try:
        pages = int(open(f"/proc/{pid}/statm").read().split()[1])
    except (OSError, ValueError, IndexError):  # gone, or not Linux
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


# The KV tiers' counters (kv_tiers.index.TierCounters fields), labelled by tier (host, disk).
_TIER_COUNTERS = (
    ("stored_blocks", "KV blocks written to the tier (evicted from the pool)"),
    ("stored_bytes", "KV payload bytes written to the tier"),
    ("loaded_blocks", "KV blocks reloaded from the tier instead of recomputed"),
    ("loaded_bytes", "KV payload bytes reloaded from the tier"),
    ("hits", "Prefix lookups past the pool that found the block in the tier"),
    ("misses", "Prefix lookups past the pool that did not find the block in the tier"),
    ("evicted_blocks", "KV blocks the tier dropped to stay within its bound (least recently used)"),
    ("failed_stores", "KV block writes that failed (full disk, I/O error): those blocks are recomputed"),
    ("failed_loads", "KV block reloads that failed (missing, truncated, corrupt or foreign file): recomputed"),
)


def _tier_metrics(t: TierStats) -> Iterator[Metric]:
    """kv_tiers.worker.TierStats as metric families."""
    p = PREFIX
    for field, doc in _TIER_COUNTERS:
        family = CounterMetricFamily(f"{p}_kv_tier_{field}", doc, labels=["tier"])
        for tier, counters in sorted(t.tiers.items()):
            family.add_metric([tier], getattr(counters, field))
        yield family
    for name, doc, values in (
        ("used_blocks", "KV blocks the tier holds now", t.used_blocks),
        ("capacity_blocks", "KV blocks the tier may hold", t.capacity_blocks),
    ):
        gauge = GaugeMetricFamily(f"{p}_kv_tier_{name}", doc, labels=["tier"])
        for tier, value in sorted(values.items()):
            gauge.add_metric([tier], value)
        yield gauge
    yield _gauge(f"{p}_kv_tier_block_bytes", "Bytes of one KV block's payload (all layers, K and V)", t.block_bytes)
    yield _counter(
        f"{p}_kv_tier_dropped_writes",
        "Offloads dropped because the disk writes queued behind the step were full",
        t.dropped_writes,
    )
    yield HistogramMetricFamily(
        f"{p}_kv_tier_reload_seconds",
        "Time from a block's reload request to its KV being ready for the step",
        buckets=t.reload.cumulative(),
        sum_value=t.reload.total_s,
    )


class HistoryCollector(Collector):
    """Reads the session history store's own operation counts when scraped: latency and errors by store
    (memory, sqlite, redis) and operation (start, commit, get, delete, renew, release, connect)."""

    def __init__(self, store: HistoryStore | None) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        store = self.store
        latency = HistogramMetricFamily(
            f"{PREFIX}_history_store_operation_seconds",
            "Time of session history store operations, by store and operation",
            labels=["store", "operation"],
        )
        errors = CounterMetricFamily(
            f"{PREFIX}_history_store_errors",
            "Session history store operations that failed (store unreachable, locked, damaged), by store and operation",
            labels=["store", "operation"],
        )
        kind = store.kind if store is not None else ""
        for op, stats in sorted(store.stats.items()) if store is not None else ():
            latency.add_metric([kind, op], stats.latency.cumulative(), stats.latency.total_s)
            errors.add_metric([kind, op], stats.errors)
        yield latency
        yield errors


def _spec_metrics(t: SpecStats) -> Iterator[Metric]:
    """engine.spec.drafter.SpecStats as metric families (speculative decoding, --speculative)."""
    p = PREFIX
    yield _counter(f"{p}_spec_steps", "Engine steps in which some sequence verified drafts", t.steps)
    yield _counter(f"{p}_spec_proposed_tokens", "Draft tokens verified", t.proposed)
    yield _counter(f"{p}_spec_accepted_tokens", "Draft tokens accepted", t.accepted)
    yield _counter(
        f"{p}_spec_emitted_tokens", "Tokens emitted by sequences that verified drafts (accepted + one each)", t.emitted
    )
    yield _counter(f"{p}_spec_verifying_sequences", "Sequence-steps that verified drafts", t.verifying)
    yield _counter(f"{p}_spec_off_steps", "Decoding steps in which the load rule left speculation off", t.off_steps)
    yield _gauge(f"{p}_spec_acceptance_rate", "Accepted over proposed draft tokens since start", t.acceptance_rate)
    yield _gauge(
        f"{p}_spec_accepted_length", "Accepted drafts per verifying sequence-step since start", t.mean_accepted
    )
    chosen = CounterMetricFamily(
        f"{p}_spec_drafts_chosen", "Sequence-steps by the number of drafts the load rule gave them", labels=["k"]
    )
    for k, n in sorted(t.k_counts.items()):
        chosen.add_metric([str(k)], n)
    yield chosen


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
