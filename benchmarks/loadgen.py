"""Closed-loop load: C clients, each sending its next request as soon as its last one finishes.

A measurement is a warm-up followed by `windows` back-to-back windows of `window_s` seconds. Clients join
spread over the first half of the warm-up, so the run does not start with one synchronised burst (except for
single-worker systems, see `closed_loop`), and are
cancelled when the last window ends (each system aborts what it has in flight). Every output token carries
its own timestamp, so each window's figures come from what happened inside that window.

Single-worker baselines (naive, dynamic batching) are measured for real at their batch size and their
queueing at higher concurrency is composed from the measured service times (see `compose_fifo`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace

from benchmarks.workload import BenchRequest


@dataclass(slots=True)
class RequestRecord:
    """What a client saw of one request. Times are `time.perf_counter()` seconds.

    `token_times` has one entry per output token, stamped when the token reached the client side.
    `group`/`started` are set by single-worker systems: the batch the request ran in and when that batch
    began. `composed_wait` is queueing time added by `compose_fifo` (0 for measured runs). `warmup` marks a
    client's shortened first request (see `closed_loop`): its tokens count, its latencies do not.
    `wanted_tokens` is how many tokens the request asked for; `client` is the closed-loop client that sent it
    (None where no closed loop did, as in a composed run).
    """

    request_id: str
    prompt_tokens: int
    submit: float
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    cached_prompt_tokens: int = 0
    group: int | None = None
    started: float | None = None
    composed_wait: float = 0.0
    error: str | None = None
    warmup: bool = False
    wanted_tokens: int = 0
    client: int | None = None

    @property
    def finished(self) -> bool:
        return self.end is not None and self.error is None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)


@dataclass(slots=True, frozen=True)
class Schedule:
    """Warm-up, then `windows` measurement windows, at one concurrency."""

    concurrency: int
    warmup_s: float
    window_s: float
    windows: int = 1

    @property
    def total_s(self) -> float:
        return self.warmup_s + self.window_s * self.windows


@dataclass(slots=True)
class Measurement:
    """Records of one run plus where its windows lie (perf_counter seconds)."""

    schedule: Schedule
    records: list[RequestRecord]
    window_starts: list[float]
    peak_memory_bytes: int | None = None
    composed_from: int | None = None

    @property
    def window_s(self) -> float:
        return self.schedule.window_s


Generate = Callable[[BenchRequest, RequestRecord], Awaitable[None]]


async def closed_loop(
    generate: Generate, requests: Iterator[BenchRequest], schedule: Schedule, spread: bool = True
) -> Measurement:
    """Run `schedule.concurrency` closed-loop clients against `generate` and return every record.

    `generate(request, record)` must fill `record.token_times` and set `record.end` on success, and must
    abort its request when cancelled.

    With `spread`, the run starts close to its steady state instead of in lockstep: clients join over the
    first half of the warm-up, and client i's first request asks for only (i + 1) / C of the new tokens, so
    completions (and the next arrivals) are spread over a request's lifetime from the start. Without it all
    clients start at once with full requests, as a single-worker batcher needs: its first, partial batches
    would otherwise persist as the closed loop's groups.
    """
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    stop_at = t0 + schedule.total_s
    ramp_s = schedule.warmup_s / 2 if spread else 0.0

    async def client(index: int) -> None:
        await asyncio.sleep(ramp_s * index / schedule.concurrency)
        first = spread
        while time.perf_counter() < stop_at:
            request = next(requests)
            shortened = False
            if first:
                first = False
                wanted = math.ceil(request.max_new_tokens * (index + 1) / schedule.concurrency)
                if wanted < request.max_new_tokens:
                    request, shortened = replace(request, max_new_tokens=wanted), True
            record = RequestRecord(request.request_id, len(request.prompt_ids), time.perf_counter())
            record.warmup, record.wanted_tokens, record.client = shortened, request.max_new_tokens, index
            records.append(record)
            try:
                await generate(request, record)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one failed request must not stop the client; it is reported
                record.error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(client(i)) for i in range(schedule.concurrency)]
    await asyncio.wait(tasks, timeout=max(0.0, stop_at - time.perf_counter()))
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result
    starts = [t0 + schedule.warmup_s + i * schedule.window_s for i in range(schedule.windows)]
    return Measurement(schedule, records, starts)


def compose_fifo(measured: Measurement, concurrency: int, group_size: int) -> Measurement:
    """The same run as seen by `concurrency` closed-loop clients queueing in front of one worker.

    `measured` is a run at concurrency == `group_size` (the worker's batch size, 1 for naive), where the
    worker is always busy and nothing queues. With more clients, the worker still runs groups of
    `group_size` back to back, in the same order (a finished group's clients resubmit together and queue
    behind the others), so token times are unchanged and each request additionally waits for the
    `concurrency / group_size - 1` groups ahead of it. Those waits are taken from the measured groups that
    precede it, cyclically. Returns a new Measurement whose records carry `composed_wait`.
    """
    if concurrency % group_size:
        raise ValueError(f"concurrency {concurrency} is not a multiple of the group size {group_size}")
    ahead = concurrency // group_size - 1
    groups: dict[int, list[RequestRecord]] = {}
    for record in measured.records:
        if record.group is not None and record.started is not None:
            groups.setdefault(record.group, []).append(record)
    order = sorted(groups, key=lambda g: groups[g][0].started)
    # Service times of the groups that finished; a group cut off by the end of the run has none.
    service = [
        max(r.end for r in groups[g]) - groups[g][0].started for g in order if all(r.end is not None for r in groups[g])
    ]
    composed: list[RequestRecord] = []
    for index, g in enumerate(order):
        wait = 0.0
        if ahead and service:
            wait = sum(service[(index - j) % len(service)] for j in range(1, ahead + 1))
        for r in groups[g]:
            composed.append(
                RequestRecord(
                    r.request_id,
                    r.prompt_tokens,
                    r.submit,
                    list(r.token_times),
                    r.end,
                    r.cached_prompt_tokens,
                    r.group,
                    r.started,
                    wait,
                    r.error,
                )
            )
    schedule = Schedule(concurrency, measured.schedule.warmup_s, measured.schedule.window_s, measured.schedule.windows)
    return Measurement(schedule, composed, list(measured.window_starts), measured.peak_memory_bytes, group_size)
