"""Server settings: frozen dataclasses built once from command-line flags and LLMSERVE_* environment variables.

Every flag `--some-flag` has the environment variable `LLMSERVE_SOME_FLAG`; a flag given on the command line
wins over the variable, and the variable over the built-in default. Boolean switches (`--no-reflection`) are
turned on by the variable set to 1/true/yes/on.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmserve.engine.config import EngineConfig
from llmserve.history import HistoryConfig, check_store_spec

ENV_PREFIX = "LLMSERVE_"
DEFAULT_ADDRESS = "0.0.0.0:50051"
LOG_FORMATS = ("text", "json")
# The history store of `python -m llmserve` when --history-store is unset: a file in the model cache directory.
DEFAULT_HISTORY_FILE = "sessions.sqlite3"
DEFAULT_CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20  # what the engine can return (llmserve.engine.request.MAX_TOP_LOGPROBS)


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Which model to load and where; `spec` None means the default model (see llmserve.models.load_model)."""

    spec: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: str | None = None


@dataclass(slots=True, frozen=True)
class InputLimits:
    """Bounds on what one request may carry; each is a flag and is answered with INVALID_ARGUMENT naming it.

    Checked at the service's edge before any tokenizer or engine work (see llmserve.limits).
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
    max_top_logprobs: int = MAX_TOP_LOGPROBS


@dataclass(slots=True, frozen=True)
class ServerConfig:
    """The gRPC front: address, admission control, authentication, limits, shutdown and logging."""

    address: str = DEFAULT_ADDRESS
    max_concurrent_streams: int = 256
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


class _Flags:
    """Adds flags whose defaults come from the environment, and says so in --help."""

    def __init__(self, parser: argparse.ArgumentParser | Any, env: Mapping[str, str]) -> None:
        self._parser = parser
        self._env = env

    def value(self, flag: str, kind: Callable[[str], Any], default: Any, help_text: str) -> None:
        name = _env_name(flag)
        raw = self._env.get(name)
        try:
            value = default if raw is None else kind(raw)
        except ValueError as exc:
            raise SystemExit(f"{name}={raw!r}: {exc}") from exc
        shown = "unset" if default is None else default
        self._parser.add_argument(flag, type=kind, default=value, help=f"{help_text} [env {name}; default {shown}]")

    def switch(self, flag: str, help_text: str) -> None:
        name = _env_name(flag)
        raw = self._env.get(name)
        try:
            value = False if raw is None else _parse_bool(raw)
        except ValueError as exc:
            raise SystemExit(f"{name}: {exc}") from exc
        self._parser.add_argument(flag, action="store_true", default=value, help=f"{help_text} [env {name}]")


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return value

    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a port number in [0, 65535], got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"must be in (0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


def _log_format(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_FORMATS:
        raise ValueError(f"must be one of {', '.join(LOG_FORMATS)}, got {text!r}")
    return value


def _roles(text: str) -> tuple[str, ...]:
    roles = tuple(role.strip() for role in text.split(",") if role.strip())
    if not roles:
        raise ValueError("give at least one role")
    return roles


def _top_logprobs(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The flags of `python -m llmserve`, with defaults taken from `env` (os.environ when None)."""
    env = os.environ if env is None else env
    engine = EngineConfig()
    server = ServerConfig()
    parser = argparse.ArgumentParser(
        prog="llmserve",
        description="Serve a language model over gRPC (llmserve.v1.GenerateService) with continuous batching.",
    )

    g = _Flags(parser.add_argument_group("model"), env)
    g.value("--model", str, None, "model: a local transformers folder, a .gguf file or random:NAME; unset: the default")
    g.value("--device", str, "auto", "device: auto, cpu, cuda, cuda:N")
    g.value("--dtype", str, "auto", "weights' dtype: auto, float32, bfloat16, float16")
    g.value("--cache-dir", str, None, "where converted models are cached; unset: ~/.cache/llmserve")

    g = _Flags(parser.add_argument_group("server"), env)
    g.value("--address", str, None, f"host:port to listen on (overrides --host/--port); default {DEFAULT_ADDRESS}")
    g.value("--host", str, DEFAULT_ADDRESS.rsplit(":", 1)[0], "interface to listen on")
    g.value("--port", int, int(DEFAULT_ADDRESS.rsplit(":", 1)[1]), "port to listen on (0: any free port)")
    g.value(
        "--max-concurrent-streams",
        _positive_int,
        server.max_concurrent_streams,
        "Generate streams in flight at once; beyond it calls get RESOURCE_EXHAUSTED",
    )
    g.value(
        "--default-max-new-tokens",
        _positive_int,
        server.default_max_new_tokens,
        "max_new_tokens for requests that leave it unset (capped by the context)",
    )
    g.value(
        "--grace-period",
        _non_negative_float,
        server.grace_period_s,
        "seconds in-flight streams get to finish after SIGTERM/SIGINT before they are cancelled",
    )
    g.switch("--no-reflection", "turn off gRPC server reflection")
    g.switch("--log-prompts", "log prompt text with each request (debugging only)")
    g.value("--log-level", str.upper, server.log_level, "DEBUG, INFO, WARNING or ERROR")
    g.value("--tls-cert", str, None, "PEM certificate chain: serve TLS (needs --tls-key); unset: plaintext")
    g.value("--tls-key", str, None, "PEM private key of --tls-cert")
    g.value("--tls-client-ca", str, None, "PEM root certificates: require client certificates signed by them")
    g.value(
        "--max-receive-message-bytes",
        _positive_int,
        server.max_receive_message_bytes,
        "largest request message accepted; beyond it RESOURCE_EXHAUSTED",
    )
    g.value(
        "--stream-stall-timeout",
        _positive_float,
        server.stream_stall_timeout_s,
        "seconds a Generate stream may wait on a client that reads nothing before it is aborted",
    )
    g.value(
        "--keepalive-min-ping-interval",
        _positive_float,
        server.keepalive_min_ping_interval_s,
        "seconds: clients may send keepalive pings this often; more often gets GOAWAY too_many_pings",
    )
    g.value("--log-format", _log_format, server.log_format, "text (key=value, caller values quoted) or json")

    g = _Flags(parser.add_argument_group("authentication"), env)
    g.value(
        "--auth-token-file",
        str,
        None,
        "Kubernetes static token file (token,identity[,...] per line): GenerateService calls need "
        "'authorization: Bearer <token>'; re-read on SIGHUP",
    )
    g.switch("--identity-from-cert", "with --tls-client-ca: the caller's identity is its certificate's SAN (or CN)")
    g.switch("--reflection-requires-auth", "with authentication on, reflection needs it too")
    g.switch(
        "--shared-prefix-cache",
        "with authentication on, share the prefix cache across identities (a common system prompt is "
        "computed once, but a caller can tell from cached_prompt_tokens what others sent)",
    )
    g.value(
        "--max-streams-per-identity",
        _positive_int,
        server.max_streams_per_identity,
        "Generate streams one identity may have in flight; beyond it RESOURCE_EXHAUSTED",
    )

    limits = InputLimits()
    g = _Flags(parser.add_argument_group("input limits (INVALID_ARGUMENT beyond them)"), env)
    g.value("--max-request-id-length", _positive_int, limits.max_request_id_length, "characters of request_id")
    g.value("--max-session-id-length", _positive_int, limits.max_session_id_length, "characters of session_id")
    g.value("--max-stop-sequences", _positive_int, limits.max_stop_sequences, "stop sequences per request")
    g.value(
        "--max-stop-sequences-chars",
        _positive_int,
        limits.max_stop_sequences_chars,
        "characters of all stop sequences of a request together",
    )
    g.value("--max-stop-token-ids", _positive_int, limits.max_stop_token_ids, "stop token ids per request")
    g.value("--max-chat-messages", _positive_int, limits.max_chat_messages, "messages per chat input")
    g.value("--chat-roles", _roles, ",".join(limits.chat_roles), "comma-separated roles a chat message may have")
    g.value(
        "--max-prompt-bytes",
        _positive_int,
        limits.max_prompt_bytes,
        "UTF-8 bytes of a text or chat input, checked before tokenization; unset: 16 per token of context",
    )
    g.value("--max-top-logprobs", _top_logprobs, limits.max_top_logprobs, "largest response.top_logprobs")

    g = _Flags(parser.add_argument_group("operations"), env)
    g.value("--metrics-port", _port, server.metrics_port, "serve Prometheus metrics at :PORT/metrics (0: off)")
    g.value(
        "--replica-name",
        str,
        None,
        "name returned in the x-llmserve-replica trailing metadata; unset: host name and port",
    )
    g.switch("--tracing", "OpenTelemetry spans for Generate calls, exported as the OTEL_* variables say")

    g = _Flags(parser.add_argument_group("engine"), env)
    g.value(
        "--kv-cache-tokens",
        _positive_int,
        engine.kv_cache_tokens,
        "KV cache size in tokens; unset: --kv-cache-memory-fraction of free memory",
    )
    g.value(
        "--kv-cache-memory-fraction",
        _fraction,
        engine.kv_cache_memory_fraction,
        "share of free device memory (CUDA) or of the CPU budget for the KV cache",
    )
    g.value("--block-size", _positive_int, engine.block_size, "tokens per KV cache block")
    g.value("--max-num-seqs", _positive_int, engine.max_num_seqs, "most sequences in one batch")
    g.value(
        "--max-num-batched-tokens",
        _positive_int,
        engine.max_num_batched_tokens,
        "most tokens in one forward (prefill chunks plus decodes)",
    )
    g.value("--max-model-len", _positive_int, engine.max_model_len, "context length cap; unset: the model's")
    g.value(
        "--max-waiting",
        _positive_int,
        engine.max_waiting,
        "requests waiting in the engine queue; beyond it calls get RESOURCE_EXHAUSTED",
    )
    g.switch("--no-prefix-caching", "turn off automatic prefix caching")
    ttl_help = "seconds an idle session's cache and history are kept"
    g.value("--session-ttl", _non_negative_float, engine.session_ttl_s, ttl_help)
    g.value(
        "--max-sessions",
        _positive_int,
        engine.max_sessions,
        "most sessions kept (caches and, counted apart, histories)",
    )
    g.value(
        "--session-pool-fraction",
        _fraction,
        engine.session_pool_fraction,
        "largest share of the KV cache idle sessions may hold",
    )
    g.value(
        "--cpu-kernels",
        _one_of("auto", "require", "off"),
        engine.cpu_kernels,
        "CPU backend's compiled kernels (built at install time): auto (use them where installed, else warn and "
        "run the torch paths), require (refuse to start without them), off",
    )
    _history_flags(_Flags(parser.add_argument_group("session histories"), env))
    g.switch("--no-cuda-graphs", "turn off CUDA graphs for the decode step")
    g.value(
        "--attention-kernel",
        _one_of("auto", "triton", "torch"),
        engine.attention_kernel,
        "CUDA attention: triton (one varlen paged kernel per layer), torch (gathered decode groups, SDPA per "
        "prompt chunk), auto (triton where installed)",
    )
    g.switch("--no-native-attention", "CPU: decode attention through torch instead of the compiled kernel")
    g.switch("--no-packed-linear", "CPU float32: plain linear layers instead of packed oneDNN weights")
    g.switch("--no-fused-layers", "CPU: transformers' own layer forward instead of the fused one (Llama family)")
    return parser


def _history_flags(g: _Flags) -> None:
    history = HistoryConfig()
    g.value(
        "--max-session-tokens",
        _positive_int,
        history.max_tokens,
        "most tokens a session's history may hold; a longer continued prompt is INVALID_ARGUMENT; unset: the context",
    )
    g.value(
        "--session-history-mib",
        _positive_float,
        history.max_bytes / (1 << 20),
        "cap of all held session histories in MiB, as the store holds them (least recently used evicted first)",
    )
    g.value(
        "--history-store",
        check_store_spec,
        None,
        "where session histories live: memory (this process), sqlite:PATH (survives restarts), "
        f"redis://HOST:PORT/DB (shared by replicas); unset: sqlite:<cache dir>/{DEFAULT_HISTORY_FILE}",
    )
    g.switch(
        "--history-store-optional",
        "start even when the history store does not answer (calls with a session id fail UNAVAILABLE until it "
        "does); without it the server exits with status 2",
    )
    g.value(
        "--history-lease",
        _positive_float,
        history.lease_s,
        "seconds a continuing call's lock on its session outlives the call's last renewal (sqlite, redis): the "
        "longest a crashed replica blocks a session",
    )


def _default_history_store(cache_dir: str | None) -> str:
    """sqlite: in the cache directory (as llmserve.models.default_cache_root finds it; --cache-dir and
    $LLMSERVE_CACHE_DIR are one setting)."""
    root = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "llmserve"
    return f"sqlite:{root / DEFAULT_HISTORY_FILE}"


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
    address = args.address or f"{args.host}:{args.port}"
    return Config(
        server=ServerConfig(
            address=address,
            max_concurrent_streams=args.max_concurrent_streams,
            default_max_new_tokens=args.default_max_new_tokens,
            grace_period_s=args.grace_period,
            reflection=not args.no_reflection,
            log_prompts=args.log_prompts,
            log_level=args.log_level,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            auth_token_file=args.auth_token_file,
            identity_from_cert=args.identity_from_cert,
            reflection_requires_auth=args.reflection_requires_auth,
            shared_prefix_cache=args.shared_prefix_cache,
            max_streams_per_identity=args.max_streams_per_identity,
            stream_stall_timeout_s=args.stream_stall_timeout,
            keepalive_min_ping_interval_s=args.keepalive_min_ping_interval,
            max_receive_message_bytes=args.max_receive_message_bytes,
            log_format=args.log_format,
            limits=InputLimits(
                max_request_id_length=args.max_request_id_length,
                max_session_id_length=args.max_session_id_length,
                max_stop_sequences=args.max_stop_sequences,
                max_stop_sequences_chars=args.max_stop_sequences_chars,
                max_stop_token_ids=args.max_stop_token_ids,
                max_chat_messages=args.max_chat_messages,
                chat_roles=args.chat_roles,
                max_prompt_bytes=args.max_prompt_bytes,
                max_top_logprobs=args.max_top_logprobs,
            ),
            history=HistoryConfig(
                ttl_s=args.session_ttl,
                max_sessions=args.max_sessions,
                max_bytes=int(args.session_history_mib * (1 << 20)),
                max_tokens=args.max_session_tokens,
                store=args.history_store or _default_history_store(args.cache_dir),
                optional=args.history_store_optional,
                lease_s=args.history_lease,
            ),
            metrics_port=args.metrics_port,
            replica_name=args.replica_name,
            tracing=args.tracing,
        ),
        model=ModelConfig(spec=args.model, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir),
        engine=EngineConfig(
            block_size=args.block_size,
            kv_cache_tokens=args.kv_cache_tokens,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_waiting=args.max_waiting,
            enable_prefix_caching=not args.no_prefix_caching,
            session_ttl_s=args.session_ttl,
            max_sessions=args.max_sessions,
            session_pool_fraction=args.session_pool_fraction,
            cpu_kernels=args.cpu_kernels,
            cuda_graphs=not args.no_cuda_graphs,
            attention_kernel=args.attention_kernel,
            native_attention=not args.no_native_attention,
            packed_linear=not args.no_packed_linear,
            fused_layers=not args.no_fused_layers,
        ),
    )
