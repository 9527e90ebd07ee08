"""The host-memory check before a model's mapped weights are read: a model that cannot fit is refused at start
with the numbers, instead of being killed by the kernel's OOM killer halfway through its first requests.

A GGUF served from its blocks is mapped, not read, when it loads (models/gguf_file.py), and the CPU's KV pool is an
anonymous mapping that the kernel fills page by page (base.zeroed): both cost memory only once touched, which
serving does. So before the backend touches either, the file's tensor bytes + the KV pool + MARGIN must fit in
what the kernel says is available (MemAvailable: free memory plus what it can reclaim, the page cache included).
"""

from __future__ import annotations

from pathlib import Path

GIB = 1 << 30
# Beside the weights and the KV pool: the engine process's Python, torch and tokenizer (~0.5 GiB resident once
# serving the default model), a step's activations, and the blocks the fused forward copies while it is built.
MARGIN = 1 * GIB
MEMINFO = Path("/proc/meminfo")


class InsufficientMemory(RuntimeError):
    """The model and its KV pool do not fit in the host's available memory; the message has the numbers and the
    flags that lower them."""


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where the file or the line is missing (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_fits(name: str, weight_bytes: int, kv_bytes: int, available: int | None, margin: int = MARGIN) -> None:
    """Raise InsufficientMemory when `weight_bytes` + `kv_bytes` + `margin` exceed `available` (None: unknown,
    nothing is checked)."""
    needed = weight_bytes + kv_bytes + margin
    if available is None or needed <= available:
        return
    raise InsufficientMemory(
        f"{name} does not fit in this host's memory: its weights ({_gib(weight_bytes)}) + the KV pool "
        f"({_gib(kv_bytes)}) + a margin of {_gib(margin)} need {_gib(needed)}, and {_gib(available)} is available "
        "(MemAvailable); lower the pool with --kv-cache-tokens, or serve a smaller file"
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
