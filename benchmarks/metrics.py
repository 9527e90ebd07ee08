"""Figures from records: per-window throughput and latency percentiles, spreads, ratios.

What each window counts (all on token timestamps, so partly finished requests count their tokens):
- output tokens/s: tokens stamped inside the window, over its length;
- requests/s: requests' worth of tokens generated inside the window (each token is 1/N of a request that
  asked for N), so partly finished requests count their share: with completions this bursty and windows
  this short, counting completions alone would be mostly noise (completion counts are kept too);
- TTFT: requests submitted after the warm-up whose first token came inside the window (plus any composed
  queue wait), so the start-up transient is left out;
- inter-token latency: gaps between consecutive tokens of a request, the later token inside the window;
- end-to-end latency: requests that finished inside the window (plus any composed queue wait);
- decode per stream: for each request that finished and whose first token came inside the window, the tokens
  after its first over the time from its first token to its last (`decode_rate`: what a user watching one stream
  sees once the answer has begun, prefill left out); the window's figure is the median over those requests;
- warm clients: the closed-loop clients that had finished a request before the window began (`steady` reads it);
- the work served, for the roofline: the prompts (new and cached tokens) of requests whose first token came
  inside the window, and the mean context (prompt plus tokens before) of the tokens generated in it.
Shortened first requests (see `loadgen.closed_loop`) count their tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from benchmarks.loadgen import Measurement

# A system's window is steady (`steady`) when every client had finished a call before it began and at least this many
# calls finished inside it. Three: at one client, a window in which three calls finished holds at least two whole ones
# (the first may have begun before it), so its decode per stream is never one call's figure; fewer finished calls make
# a fragment of a call, not a window.
STEADY_MIN_CALLS = 3

FIGURES = (
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
)


@dataclass(slots=True)
class WindowStats:
    """One measurement window's figures; latencies are None when the window saw no sample."""

    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    completed: int
    ttft_samples: int
    errors: int
    window_s: float = 0.0
    prefills: list[tuple[int, int]] = field(default_factory=list)  # (new, cached) prompt tokens
    decode_context_mean: float | None = None
    decode_per_stream_p50: float | None = None  # tokens/s after the first token, median over calls (`decode_rate`)
    decode_samples: int = 0
    warm_clients: int = 0  # closed-loop clients that had finished a call before the window began


@dataclass(slots=True)
class PointSummary:
    """One system at one concurrency: the mean over windows and the spread (max - min) of each figure."""

    system: str
    concurrency: int
    windows: list[WindowStats]
    mean: dict[str, float | None]
    spread: dict[str, float | None]
    peak_memory_bytes: int | None
    composed_from: int | None

    def to_json(self) -> dict:
        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "windows": [asdict(w) for w in self.windows],
            "mean": self.mean,
            "spread": self.spread,
            "peak_memory_bytes": self.peak_memory_bytes,
            "composed_from_concurrency": self.composed_from,
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def decode_rate(token_times: Sequence[float]) -> float | None:
    """One call's decode rate as its user watches it: the tokens after the first over the time from the first token to
    the last, in tokens/s; None for a call of fewer than two tokens or whose tokens all came at once."""
    if len(token_times) < 2 or token_times[-1] <= token_times[0]:
        return None
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


def steady(window: WindowStats, clients: int) -> bool:
    """Whether one system's window measured its steady state, not its start (issue 52): each of its `clients`
    closed-loop clients had finished a call before the window began, so the opening round (every client's first
    prompt prefilled at once, the clients joining) was over; and at least STEADY_MIN_CALLS calls finished inside it.
    A window that caught one server still in its opening prefills and the other decoding compared two warm-ups
    (40x at 32 clients). Whole calls need not fit in the window: at 32 clients a call can outlive a minute's window
    while the load of desynchronised clients is steady all the same."""
    return window.warm_clients >= clients and window.completed >= STEADY_MIN_CALLS


def window_stats(measurement: Measurement, index: int) -> WindowStats:
    start = measurement.window_starts[index]
    end = start + measurement.window_s
    warm_end = measurement.window_starts[0]
    tokens = 0
    request_share = 0.0
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    completed = errors = 0
    prefills: list[tuple[int, int]] = []
    context_sum = 0
    decode: list[float] = []
    warm: set[int] = set()
    for r in measurement.records:
        times = r.token_times
        if r.finished and r.client is not None and r.end is not None and r.end < start:
            warm.add(r.client)
        inside = [i for i, t in enumerate(times) if start <= t < end]  # token i had prompt + i tokens before it
        tokens += len(inside)
        context_sum += sum(r.prompt_tokens + i for i in inside)
        if times and start <= times[0] < end:
            cached = min(r.cached_prompt_tokens, r.prompt_tokens)
            prefills.append((r.prompt_tokens - cached, cached))
        if inside:
            request_share += len(inside) / (r.wanted_tokens or len(times))
        itl.extend(b - a for a, b in zip(times, times[1:], strict=False) if start <= b < end)
        if r.warmup:
            continue  # a shortened first request: its tokens count, its latencies would flatter
        if times and start <= times[0] < end and r.submit >= warm_end:
            ttft.append(times[0] - r.submit + r.composed_wait)
        if r.error is None and r.end is not None and start <= r.end < end:
            completed += 1
            e2e.append(r.end - r.submit + r.composed_wait)
        elif r.error is not None and start <= r.submit < end:
            errors += 1
        if r.finished and times and start <= times[0] < end and (rate := decode_rate(times)) is not None:
            decode.append(rate)
    return WindowStats(
        requests_per_s=request_share / measurement.window_s,
        output_tokens_per_s=tokens / measurement.window_s,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50),
        itl_p99_s=percentile(itl, 99),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p99_s=percentile(e2e, 99),
        completed=completed,
        ttft_samples=len(ttft),
        errors=errors,
        window_s=measurement.window_s,
        prefills=prefills,
        decode_context_mean=context_sum / tokens if tokens else None,
        decode_per_stream_p50=percentile(decode, 50),
        decode_samples=len(decode),
        warm_clients=len(warm),
    )


def summarize(system: str, measurement: Measurement) -> PointSummary:
    windows = [window_stats(measurement, i) for i in range(len(measurement.window_starts))]
    mean: dict[str, float | None] = {}
    spread: dict[str, float | None] = {}
    for name in FIGURES:
        values = [getattr(w, name) for w in windows if getattr(w, name) is not None]
        mean[name] = sum(values) / len(values) if values else None
        spread[name] = max(values) - min(values) if len(values) > 1 else None
    return PointSummary(
        system,
        measurement.schedule.concurrency,
        windows,
        mean,
        spread,
        measurement.peak_memory_bytes,
        measurement.composed_from,
    )


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None when either is missing or the base is zero."""
    if value is None or base is None or base == 0:
        return None
    return value / base


def relative_spread(summary: PointSummary, name: str) -> float | None:
    """Spread of a figure as a fraction of its mean: a difference between systems below this is noise."""
    return ratio(summary.spread.get(name), summary.mean.get(name))
