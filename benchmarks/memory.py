"""Peak memory of a process: the kernel's RSS high-water mark (VmHWM), which can be reset between points.

For a server process (not this one) its children count too: `python -m llmserve` keeps the weights and the KV
cache in its engine process. The figure is then the sum of each one's peak (at most that above the peak of the
sum).

On CUDA the figure that matters is the allocator's peak on the device, read in-process.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def reset_peak(pid: int, device: torch.device) -> None:
    """Start a new high-water mark for `pid` (and for the CUDA allocator, when in-process on CUDA)."""
    if device.type == "cuda" and pid == os.getpid():
        torch.cuda.reset_peak_memory_stats(device)
    for each in _with_children(pid):
        try:
            with open(f"/proc/{each}/clear_refs", "w") as f:
                f.write("5")  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            pass  # not Linux, or not allowed: the peak then covers the process's whole life


def peak_bytes(pid: int, device: torch.device) -> int | None:
    """Peak memory since the last reset: CUDA allocator peak in-process on CUDA, else peak RSS of `pid`."""
    if device.type == "cuda" and pid == os.getpid():
        return int(torch.cuda.max_memory_allocated(device))
    peaks = [peak for each in _with_children(pid) if (peak := _hwm(each)) is not None]
    if peaks:
        return sum(peaks)
    if pid == os.getpid():
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return None


def peak_of(pid: int, device: torch.device, run: Callable[[], T]) -> tuple[T, int | None]:
    """`run()`'s result, and the peak memory of `pid` (as `peak_bytes` reads it) from its start to its end."""
    reset_peak(pid, device)
    result = run()
    return result, peak_bytes(pid, device)


def _hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _with_children(pid: int) -> list[int]:
    """`pid`, and its children unless it is this process (whose children are other systems' servers)."""
    if pid == os.getpid():
        return [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid, *map(int, f.read().split())]
    except OSError:
        return [pid]
