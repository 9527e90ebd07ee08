"""Systems measured in turn, so that the machine's drift falls on all alike: for the modes that compare servers side
by side (dtypes, gguf: `alternate`), each round gives every system one window at each client count; for the embed
mode's parts (`in_turn`), one run per system a round; both reverse the order every other round. The probes that time
variants in one process (`rotated_times`) rotate the order instead, one step a repetition."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.loadgen import Measurement, Schedule
from benchmarks.metrics import WindowStats, steady, summarize
from benchmarks.systems.base import System
from benchmarks.workload import PromptMaker, RequestStream

ROOM_S = 2.0  # after each window: the aborted requests leave the server before the next window starts


async def alternate(
    chosen: dict[str, tuple[System, tuple]], clients: list[int], args: argparse.Namespace, maker: PromptMaker
) -> dict[str, dict[int, list[Any]]]:
    """One window per system per round at each client count, the systems' order reversed every other round;
    within a round every system gets the same requests. Each system is `prepare`d for a client count before its
    windows there. Returns each system's measurements per client count."""
    names = list(chosen)
    out: dict[str, dict[int, list[Any]]] = {n: {c: [] for c in clients} for n in names}
    start = 0
    for c in clients:
        for name in names:  # outside the windows: a server sized by its client count restarts here
            await chosen[name][0].prepare(c)
        for r in range(args.rounds):
            for name in turn(names, r):
                schedule = Schedule(c, args.warmup_s, args.window_s, 1)
                measurement = await chosen[name][0].run(RequestStream(maker, start), schedule)
                out[name][c].append(measurement)
                w = window_of(measurement)
                decode = "–" if w.decode_per_stream_p50 is None else f"{w.decode_per_stream_p50:.1f}"
                print(
                    f"{c} clients, round {r + 1}: {name} {w.output_tokens_per_s:.1f} output tok/s, "
                    f"decode per stream {decode}",
                    flush=True,
                )
                await asyncio.sleep(ROOM_S)
            start += 10_000  # the next round's prompts are new to every server's cache
    return out


def turn(names: Sequence[str], round_: int) -> Sequence[str]:
    """The systems' order in round `round_`: as given, reversed every other round."""
    return names if round_ % 2 == 0 else names[::-1]


def in_turn(
    systems: Sequence[str], rounds: int, run: Callable[[str], dict[str, Any]], tag: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    """`rounds` rounds of one `run(system)` per system, in `turn` order; each run's figures are printed (after `tag`)
    as it ends. Returns each system's figures, run by run."""
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
    for k in range(rounds):
        for system in turn(systems, k):
            runs[system].append(run(system))
            print({**tag, "set": k, "system": system, **runs[system][-1]}, flush=True)
    return runs


def medians(runs: dict[str, list[dict[str, Any]]], keys: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """Each system's median of each figure over its runs (None where no run has the figure)."""

    def median(system: str, key: str) -> float | None:
        values = [run[key] for run in runs[system] if run[key] is not None]
        return statistics.median(values) if values else None

    return {system: {key: median(system, key) for key in keys} for system in runs}


def rotated_times(variants: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Each variant called once a repetition, the order rotated one step each repetition: each call's seconds."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            started = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - started)
    return times


def window_of(measurement: Measurement) -> WindowStats:
    """The one window of an `alternate` measurement."""
    return summarize("", measurement).windows[0]


def steady_rounds(measurements: dict[str, list[Measurement]], clients: int) -> list[bool]:
    """Each round's steadiness at `clients` clients: a round counts when every system's window in it is steady
    (metrics.steady), so that no ratio compares one system's warm-up with another's steady state."""
    rounds = zip(*measurements.values(), strict=True)
    return [all(steady(window_of(m), clients) for m in ms) for ms in rounds]


def point(measurements: list[Any], counted: Sequence[bool] | None = None) -> dict[str, Any]:
    """A system at one client count, from its windows: each window's output tokens/s, the medians of throughput,
    TTFT and decode per stream, the errors and the peak resident memory. With `counted` (a flag per window, as
    `steady_rounds` gives), the medians are over the counted windows only (None where none is); each window's
    figures and flag are listed under "rounds" all the same."""
    windows = [window_of(m) for m in measurements]
    counts = list(counted) if counted is not None else [True] * len(windows)
    kept = [w for w, keep in zip(windows, counts, strict=True) if keep]

    def median(figure: str) -> float | None:
        values = [getattr(w, figure) for w in kept if getattr(w, figure) is not None]
        return statistics.median(values) if values else None

    peaks = [m.peak_memory_bytes for m in measurements if m.peak_memory_bytes is not None]
    return {
        "output_tokens_per_s": [round(w.output_tokens_per_s, 2) for w in windows],
        "median_output_tokens_per_s": median("output_tokens_per_s"),
        "median_decode_per_stream": median("decode_per_stream_p50"),
        "ttft_p50_s": median("ttft_p50_s"),
        "ttft_p99_s": median("ttft_p99_s"),
        "ttft_samples": sum(w.ttft_samples for w in kept),
        "decode_samples": sum(w.decode_samples for w in kept),
        "counted_windows": len(kept),
        "rounds": [
            {
                "output_tokens_per_s": round(w.output_tokens_per_s, 2),
                "decode_per_stream": None if w.decode_per_stream_p50 is None else round(w.decode_per_stream_p50, 2),
                "decode_samples": w.decode_samples,
                "ttft_p50_s": w.ttft_p50_s,
                "completed": w.completed,
                "warm_clients": w.warm_clients,
                "counted": keep,
            }
            for w, keep in zip(windows, counts, strict=True)
        ],
        "errors": sum(w.errors for w in windows),
        "peak_memory_bytes": max(peaks) if peaks else None,
    }
