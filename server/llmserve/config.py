"""Server settings: frozen dataclasses built once from command-line flags and LLMSERVE_* environment variables.

Each flag is declared once, in FLAGS: its name, the config field(s) it sets, how its text parses, its help.
Its default is that field's dataclass default, its environment variable `LLMSERVE_SOME_FLAG` is made from its
name, and the parser and the mapping onto the dataclasses are generated from the table. A flag given on the
command line wins over the variable, and the variable over the built-in default. Switches (`--no-reflection`)
are turned on by the variable set to 1/true/yes/on; a `--no-...` switch turns its field off.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from llmserve.engine.config import EngineConfig
from llmserve.flags import DEFAULT_ADDRESS, FLAGS, Flag
from llmserve.history import HistoryConfig

ENV_PREFIX = "LLMSERVE_"
# The history store of `python -m llmserve` when --history-store is unset: a file in the model cache directory.
DEFAULT_HISTORY_FILE = "sessions.sqlite3"
DEFAULT_CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Which model to load and where; `spec` None means the default model (see llmserve.models.loader.load_model)."""

    spec: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    # How the kernels over a GGUF's blocks take a linear's input rows: "int8" per block of 32 (llama.cpp's scheme,
    # the fastest), or "float32" (the float32 path's tokens; as fast at 1-4 rows, about float32's speed from 32).
    gguf_activations: str = "float32"
    # How an encoder's float32 linears multiply: "auto" (three bfloat16 products on AMX where the CPU has it, else
    # float32's own), "ieee" or "bf16x3" (engine/backends/cpu/split_linear.py).
    fp32_matmul: str = "auto"
    cache_dir: str | None = None
    # Embed from a generative model: how its final hidden states are pooled ("last", "mean", "cls", "max"); None:
    # the folder's sentence-transformers pooling if it has one (an encoder folder always has its own).
    pooling: str | None = None
    # The engine core in a process of its own (engine/core/process.py), so that the step loop does not share the
    # front end's GIL; False: on a thread of the server's process.
    engine_process: bool = True


@dataclass(slots=True, frozen=True)
class InputLimits:
    """Bounds on what one request may carry; each is a flag and is answered with INVALID_ARGUMENT naming it.

    Checked at the service's edge before any tokenizer or engine work (see llmserve.api.limits).
    """

    max_request_id_length: int = 128
    max_session_id_length: int = 128
    max_stop_sequences: int = 16
    max_stop_sequences_chars: int = 1024  # all stop sequences together
    max_stop_token_ids: int = 64
    max_chat_messages: int = 512
    chat_roles: tuple[str, ...] = DEFAULT_CHAT_ROLES
    # UTF-8 bytes of text/chat input; None: 16 bytes per token of the model's context (known once it loads).
    max_prompt_bytes: int | None = None
    max_logit_bias: int = 300  # entries of sampling.logit_bias (OpenAI's limit)
    max_constraint_chars: int = 65536  # characters of a constraint's schema, regex or grammar, or all its choices
    max_embed_inputs: int = 256  # inputs of one Embed call


@dataclass(slots=True, frozen=True)
class ServerConfig:
    """The gRPC front: address, admission control, authentication, limits, shutdown and logging."""

    address: str = DEFAULT_ADDRESS
    max_concurrent_streams: int = 256
    # Inputs of pooling calls (Embed's inputs, Rerank's documents) in flight at once, each an engine request: with
    # the streams' 256, the engine queue's 1024 (--max-waiting), so that embedding traffic never fills the queue
    # Generate needs.
    max_pooling_inputs: int = 768
    default_max_new_tokens: int = 256
    grace_period_s: float = 10.0
    reflection: bool = True
    log_prompts: bool = False
    log_level: str = "INFO"
    # PEM files. A certificate and key serve TLS; a client CA as well requires client certificates (mTLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Authentication: callers named by a bearer token (Kubernetes static token file) or by their client
    # certificate. Off when neither is set.
    auth_token_file: str | None = None
    identity_from_cert: bool = False
    reflection_requires_auth: bool = False
    # With authentication on, the prefix cache is per identity unless this shares it across identities.
    shared_prefix_cache: bool = False
    max_streams_per_identity: int | None = None
    # With authentication on, the identities that may call AdapterService (load/unload adapters).
    admin_identities: tuple[str, ...] = ()
    # A stream whose next message has waited this long on the client's flow control is aborted.
    stream_stall_timeout_s: float = 30.0
    # Clients may send keepalive pings this often (gRPC's own default allows one per 5 minutes).
    keepalive_min_ping_interval_s: float = 5.0
    max_receive_message_bytes: int = 4 * 1024 * 1024
    log_format: str = "text"
    limits: InputLimits = field(default_factory=InputLimits)

    # Session histories (append mode): TTL and count follow the engine's session flags.
    history: HistoryConfig = field(default_factory=HistoryConfig)
    # Operations: Prometheus /metrics port (0: off), the name sent back in x-llmserve-replica (None:
    # host name and port), and OpenTelemetry tracing (configured by the OTEL_* variables).
    metrics_port: int = 0
    replica_name: str | None = None
    tracing: bool = False

    @property
    def auth_enabled(self) -> bool:
        return self.auth_token_file is not None or self.identity_from_cert


@dataclass(slots=True, frozen=True)
class Config:
    """Everything `python -m llmserve` needs, passed down explicitly."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def all_flags() -> list[Flag]:
    return [flag for _, group in FLAGS for flag in group]


def _dest(flag: Flag) -> str:
    return flag.name.lstrip("-").replace("-", "_")


def _field_default(path: str) -> Any:
    value: Any = Config()
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _flag_default(flag: Flag) -> Any:
    """The flag's value when neither the command line nor the environment sets it: its field's default."""
    value = _field_default(flag.targets[0])
    if flag.parse is None:
        return not value if flag.invert else value
    return flag.from_field(value) if flag.from_field is not None and value is not None else value


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The flags of `python -m llmserve` (generated from FLAGS), with defaults taken from `env` (os.environ
    when None)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="llmserve",
        description="Serve a language model over gRPC (llmserve.v1.GenerateService) with continuous batching.",
    )
    for title, group_flags in FLAGS:
        group = parser.add_argument_group(title)
        for flag in group_flags:
            name, default = _env_name(flag.name), _flag_default(flag)
            raw = env.get(name)
            try:
                if flag.parse is None:
                    value = default if raw is None else _parse_bool(raw)
                elif flag.repeated:
                    value = default if raw is None else tuple(flag.parse(v) for v in raw.split(",") if v.strip())
                else:
                    value = default if raw is None else flag.parse(raw)
            except ValueError as exc:
                raise SystemExit(f"{name}={raw!r}: {exc}") from exc
            if flag.parse is None:
                group.add_argument(flag.name, action="store_true", default=value, help=f"{flag.help} [env {name}]")
            elif flag.repeated:  # each use adds to the tuple (argparse's append would add to the default)
                group.add_argument(
                    flag.name, type=flag.parse, action=_Extend, default=value,
                    help=f"{flag.help} [env {name}, comma-separated; default {flag.shown(default)}]",
                )  # fmt: skip
            else:
                shown = "unset" if default is None else flag.shown(default)
                group.add_argument(
                    flag.name, type=flag.parse, default=value, help=f"{flag.help} [env {name}; default {shown}]"
                )
    return parser


class _Extend(argparse.Action):
    """A repeated flag: the command line's values replace the environment's, in order."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        given = getattr(namespace, f"_{self.dest}_given", False)
        current = getattr(namespace, self.dest) if given else ()
        setattr(namespace, self.dest, (*current, values))
        setattr(namespace, f"_{self.dest}_given", True)


def _with(obj: Any, values: Mapping[str, Any], prefix: str = "") -> Any:
    """`obj` (a config dataclass) with the fields named by dotted paths in `values` replaced, nested ones too."""
    changes: dict[str, Any] = {}
    for f in fields(obj):
        path = prefix + f.name
        child = getattr(obj, f.name)
        if is_dataclass(child) and any(key.startswith(path + ".") for key in values):
            changes[f.name] = _with(child, values, path + ".")
        elif path in values:
            changes[f.name] = values[path]
    return replace(obj, **changes)


def from_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Parse flags (sys.argv[1:] when None) over environment defaults into a Config."""
    parser = build_parser(env)
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    if args.identity_from_cert and args.tls_client_ca is None:
        parser.error("--identity-from-cert needs --tls-client-ca")
    if args.identity_from_cert and args.auth_token_file is not None:
        parser.error("--identity-from-cert and --auth-token-file are two ways to name callers: pick one")
    _check_lora(parser, args)
    values: dict[str, Any] = {}
    for flag in all_flags():
        value = getattr(args, _dest(flag))
        if flag.invert:
            value = not value
        elif flag.to_field is not None and value is not None:
            value = flag.to_field(value)
        for target in flag.targets:
            values[target] = value
    if values["server.history.store"] is None:
        values["server.history.store"] = _default_history_store(values["model.cache_dir"])
    config: Config = _with(Config(), values)
    return config


def _check_lora(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    names = [name for name, _ in args.lora]
    if len(names) != len(set(names)):
        parser.error(f"--lora: a name is given twice ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    cpu = args.max_cpu_loras
    if cpu is not None and cpu < args.max_loras:
        parser.error(f"--max-cpu-loras {cpu} is below --max-loras {args.max_loras}")
    if cpu is not None and cpu < len(names):
        parser.error(f"{len(names)} --lora adapters do not fit --max-cpu-loras {cpu}")


def _default_history_store(cache_dir: str | None) -> str:
    """sqlite: in the cache directory (as llmserve.models.cache.default_cache_root finds it; --cache-dir and
    $LLMSERVE_CACHE_DIR are one setting)."""
    root = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "llmserve"
    return f"sqlite:{root / DEFAULT_HISTORY_FILE}"
