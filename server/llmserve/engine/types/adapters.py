"""What the flags, the gRPC edge and the engine share about adapters, torch-free: the name rule and the rank bound,
the errors of reading, naming and loading an adapter (each mapped to a status at the edge), the AdapterService's
operations and answers, and an adapter as the list RPC shows it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MAX_LORA_RANK = 256  # the largest --max-lora-rank (vLLM serves up to 512; 256 is far past what fine-tunes use)
MAX_ADAPTER_NAME_LENGTH = 128
# What a name may hold: letters, digits and . _ - / : @ (a Hugging Face repo id, a version tag), so that it is safe
# in a metric label, a log line and the gateways' comma-separated lists (no commas, no spaces).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:@]*")


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None when it can."""
    if len(name) > MAX_ADAPTER_NAME_LENGTH:
        return f"is {len(name)} characters, the limit is {MAX_ADAPTER_NAME_LENGTH}"
    if _NAME.fullmatch(name) is None:
        return "must start with a letter or digit and hold only letters, digits and . _ - / : @"
    return None


def check_adapter_name(name: str) -> None:
    """Raises ValueError when `name` cannot name an adapter."""
    problem = adapter_name_problem(name)
    if problem is not None:
        raise ValueError(f"adapter name {name!r} {problem}")


class AdapterRefused(ValueError):
    """An adapter that cannot be served: `path` names the file (or folder) and `reason` what does not fit."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # across the engine process's pipe
        return type(self), (self.path, self.reason)


class LoraUnsupported(ValueError):
    """A setting LoRA adapters are not served with (the fused CPU forward in bfloat16 or int8): stops the start."""


class AdapterNotFound(AdapterRefused):
    """The adapter's folder, or a file it must hold, does not exist."""


class UnknownAdapter(LookupError):
    """No adapter is registered under `name`."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no adapter named {name!r} is loaded")
        self.name = name

    def __reduce__(self) -> tuple[type, tuple[str]]:  # across the engine process's pipe, as it was raised
        return type(self), (self.name,)


class AdapterExists(ValueError):
    """A load under a name that is registered already (unload it first to replace it)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"an adapter named {name!r} is loaded already; unload it first to replace it")
        self.name = name

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return type(self), (self.name,)


class AdaptersBusy(RuntimeError):
    """No room: all `max_cpu_loras` resident adapters are held by requests (or draining)."""

    def __init__(self, name: str, max_cpu_loras: int) -> None:
        super().__init__(
            f"cannot load adapter {name!r}: all {max_cpu_loras} adapters in memory (--max-cpu-loras) are in use by "
            "requests; retry when one finishes"
        )
        self.name = name
        self.max_cpu_loras = max_cpu_loras

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return type(self), (self.name, self.max_cpu_loras)


@dataclass(slots=True, frozen=True)
class AdapterInfo:
    """One registered adapter as the list RPC shows it."""

    name: str
    path: str
    rank: int  # 0 while it is not in memory (unloaded to make room: read again on the next request)
    target_modules: tuple[str, ...]
    resident: bool
    running_requests: int  # requests that hold it now (waiting or running)
    host_bytes: int


@dataclass(slots=True, frozen=True)
class LoraLimits:
    """The bounds the list RPC and GetModelInfo report."""

    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int


@dataclass(slots=True, frozen=True)
class LoadAdapter:
    """Read the adapter folder `path` and serve it as `name` (AdapterService.LoadAdapter)."""

    name: str
    path: str


@dataclass(slots=True, frozen=True)
class UnloadAdapter:
    """Forget `name`; requests that hold it finish on it (AdapterService.UnloadAdapter)."""

    name: str


@dataclass(slots=True, frozen=True)
class ListAdapters:
    """Every registered adapter and the limits (AdapterService.ListAdapters)."""


AdapterOp = LoadAdapter | UnloadAdapter | ListAdapters


@dataclass(slots=True, frozen=True)
class AdapterAnswer:
    """The engine core's answer to an AdapterOp: `loaded` (LoadAdapter), `draining` (UnloadAdapter: requests still
    on it), `adapters` and `limits` (always: the front end keeps the names it checks requests against from them)."""

    adapters: tuple[AdapterInfo, ...]
    limits: LoraLimits
    loaded: AdapterInfo | None = None
    draining: int = 0

    @property
    def names(self) -> frozenset[str]:
        return frozenset(info.name for info in self.adapters)
