"""Systems measured window by window in turn, for the modes that compare servers side by side (dtypes, gguf): each
round gives every system one window at each client count, the order reversed every other round, so that the
machine's drift falls on all alike."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from benchmarks.loadgen import Schedule
from benchmarks.metrics import summarize
from benchmarks.systems.base import System
from benchmarks.workload import PromptMaker, RequestStream

ROOM_S = 2.0  # after each window: the aborted requests leave the server before the next window starts


async def alternate(
    chosen: dict[str, tuple[System, tuple]], clients: list[int], args: argparse.Namespace, maker: PromptMaker
) -> dict[str, dict[int, list[Any]]]:
    """One window per system per round at each client count, the systems' order reversed every other round;
    within a round every system gets the same requests. Returns each system's measurements per client count."""
    names = list(chosen)
    out: dict[str, dict[int, list[Any]]] = {n: {c: [] for c in clients} for n in names}
    start = 0
    for c in clients:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                schedule = Schedule(c, args.warmup_s, args.window_s, 1)
                measurement = await chosen[name][0].run(RequestStream(maker, start), schedule)
                out[name][c].append(measurement)
                rate = summarize(name, measurement).mean["output_tokens_per_s"] or 0.0
                print(f"{c} clients, round {r + 1}: {name} {rate:.1f} output tok/s", flush=True)
                await asyncio.sleep(ROOM_S)
            start += 10_000  # the next round's prompts are new to every server's cache
    return out


def point(measurements: list[Any]) -> dict[str, Any]:
    """A system at one client count, from its windows: each window's output tokens/s, the medians of throughput and
    TTFT, the errors and the peak resident memory."""
    windows = [summarize("", m).windows[0] for m in measurements]

    def median(figure: str) -> float | None:
        values = [getattr(w, figure) for w in windows if getattr(w, figure) is not None]
        return statistics.median(values) if values else None

    peaks = [m.peak_memory_bytes for m in measurements if m.peak_memory_bytes is not None]
    return {
        "output_tokens_per_s": [round(w.output_tokens_per_s, 2) for w in windows],
        "median_output_tokens_per_s": median("output_tokens_per_s"),
        "ttft_p50_s": median("ttft_p50_s"),
        "ttft_p99_s": median("ttft_p99_s"),
        "ttft_samples": sum(w.ttft_samples for w in windows),
        "errors": sum(w.errors for w in windows),
        "peak_memory_bytes": max(peaks) if peaks else None,
    }
