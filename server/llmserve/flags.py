"""The flags of `python -m llmserve`, each declared once: `FLAGS`, read by llmserve.config, which generates the
parser, the environment variables and the mapping onto the config dataclasses from it (a flag's default is its
field's dataclass default). Add a setting by adding its field to a config dataclass and one entry here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from llmserve.engine.types.adapters import MAX_LORA_RANK, check_adapter_name
from llmserve.engine.types.request import MAX_TOP_LOGPROBS
from llmserve.history import check_store_spec

DEFAULT_ADDRESS = "0.0.0.0:50051"
LOG_FORMATS = ("text", "json")
N = TypeVar("N", int, float)


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return value

    return parse


def _checked(convert: Callable[[str], N], holds: Callable[[N], bool], bound: str) -> Callable[[str], N]:
    """`convert`, refusing a value for which `holds` is false with "must be <bound>, got <value>"."""

    def parse(text: str) -> N:
        value = convert(text)
        if not holds(value):
            raise ValueError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = convert.__name__  # argparse names the type in its refusal: "invalid int value"
    return parse


_positive_int = _checked(int, lambda v: v >= 1, ">= 1")
_port = _checked(int, lambda v: 0 <= v <= 65535, "a port number in [0, 65535]")
_top_logprobs = _checked(int, lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]")
_lora_rank = _checked(int, lambda v: 1 <= v <= MAX_LORA_RANK, f"in [1, {MAX_LORA_RANK}]")
_fraction = _checked(float, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
_positive_float = _checked(float, lambda v: v > 0, "> 0")
_non_negative_float = _checked(float, lambda v: v >= 0, ">= 0")
_non_negative_int = _checked(int, lambda v: v >= 0, ">= 0")
_log_format = _one_of(*LOG_FORMATS)


def _address(text: str) -> str:
    """host:port (an IPv6 host in brackets, `[::1]:50051`); port 0 picks any free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError(f"must be host:port (an IPv6 host in brackets), got {text!r}")
    _port(port)
    return text


def _roles(text: str) -> tuple[str, ...]:
    roles = tuple(role.strip() for role in text.split(",") if role.strip())
    if not roles:
        raise ValueError("give at least one role")
    return roles


def _named_path(text: str) -> tuple[str, str]:
    """NAME=PATH (a --lora adapter): the name a request gives in GenerateRequest.adapter, and its folder."""
    name, sep, path = text.partition("=")
    name = name.strip()
    if not sep or not name or not path.strip():
        raise ValueError(f"must be NAME=PATH, got {text!r}")
    check_adapter_name(name)
    return name, path.strip()


def _named_paths_text(values: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{name}={path}" for name, path in values) or "none"


def _identity(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError("an identity is not empty")
    return value


def _identities_text(values: tuple[str, ...]) -> str:
    return ",".join(values) or "none"


def _mib_to_bytes(mib: float) -> int:
    return int(mib * (1 << 20))


def _bytes_to_mib(nbytes: int) -> float:
    return nbytes / (1 << 20)


def _gib_to_bytes(gib: float) -> int:
    return int(gib * (1 << 30))


def _bytes_to_gib(nbytes: int) -> float:
    return nbytes / (1 << 30)


@dataclass(slots=True, frozen=True)
class Flag:
    """One flag. `targets` are dotted paths into Config ("engine.block_size"); a flag may set several fields
    (the session TTL is the cache's and the history's).
    `parse` None makes a switch; `invert` a switch that turns its field off. `to_field`/`from_field` convert
    between the flag's unit and the field's (MiB and bytes). `repeated`: the flag may be given many times; its
    field is the tuple of the values (its environment variable: the values separated by commas)."""

    name: str
    targets: tuple[str, ...]
    help: str
    parse: Callable[[str], Any] | None = None
    invert: bool = False
    to_field: Callable[[Any], Any] | None = None
    from_field: Callable[[Any], Any] | None = None
    shown: Callable[[Any], str] = str  # how --help writes the default
    repeated: bool = False


def _flag(name: str, target: str | tuple[str, ...], parse: Callable[[str], Any], help_text: str, **kw: Any) -> Flag:
    return Flag(name, (target,) if isinstance(target, str) else target, help_text, parse, **kw)


def _switch(name: str, target: str, help_text: str, *, invert: bool = False) -> Flag:
    return Flag(name, (target,), help_text, invert=invert)


def _roles_text(roles: tuple[str, ...]) -> str:
    return ",".join(roles)


# (group title, its flags), in --help order.
FLAGS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    (
        "model",
        (
            _flag("--model", "model.spec", str, "model: a local transformers folder, a .gguf file or random:NAME; "
                  "unset: the default"),
            _flag("--device", "model.device", str, "device: auto, cpu, cuda, cuda:N"),
            _flag("--dtype", "model.dtype", str, "weights' dtype: auto, gguf, float32, bfloat16, float16, int8; gguf "
                  "serves a .gguf file from its own blocks on the CPU (what auto does for a GGUF there), the others "
                  "dequantize it once into a cached float copy"),
            _flag("--gguf-activations", "model.gguf_activations", _one_of("float32", "int8"),
                  "with a GGUF's blocks: the linears' input rows kept float32 (the default: the float32 path's "
                  "greedy tokens on the file's weights), or quantized to int8 per block of 32 as llama.cpp does "
                  "(llama.cpp's tokens; less compute per weight, for throughput)"),
            _flag("--fp32-matmul", "model.fp32_matmul", _one_of("auto", "ieee", "bf16x3"),
                  "an encoder's float32 linears: bf16x3 computes each as three bfloat16 products on AMX tiles (error "
                  "~4e-6 of the output, float32's ~6e-7; about twice as fast), ieee as float32's own GEMM; auto: "
                  "bf16x3 where the CPU has AMX-BF16"),
            _flag("--cache-dir", "model.cache_dir", str, "where converted models are cached; unset: ~/.cache/llmserve"),
            _flag("--pooling", "model.pooling", _one_of("last", "mean", "cls", "max"),
                  "serve Embed from a generative model too: its final hidden states pooled over each input's tokens "
                  "(last token, mean, first token, maximum); unset: the model folder's sentence-transformers pooling, "
                  "if any"),
            _switch("--engine-in-process", "model.engine_process",
                    "run the engine core on a thread of the server's process, not in a process of its own",
                    invert=True),
        ),
    ),
    (
        "server",
        (
            _flag("--address", "server.address", _address, "host:port to listen on (port 0: any free port)"),
            _flag("--max-concurrent-streams", "server.max_concurrent_streams", _positive_int,
                  "Generate streams in flight at once; beyond it calls get RESOURCE_EXHAUSTED"),
            _flag("--max-pooling-inputs", "server.max_pooling_inputs", _positive_int,
                  "inputs of Embed calls (documents of Rerank calls) in flight at once (at least --max-embed-inputs); "
                  "a call beyond it is refused whole with RESOURCE_EXHAUSTED"),
            _flag("--default-max-new-tokens", "server.default_max_new_tokens", _positive_int,
                  "max_new_tokens for requests that leave it unset (capped by the context)"),
            _flag("--grace-period", "server.grace_period_s", _non_negative_float,
                  "seconds in-flight streams get to finish after SIGTERM/SIGINT before they are cancelled"),
            _switch("--no-reflection", "server.reflection", "turn off gRPC server reflection", invert=True),
            _switch("--log-prompts", "server.log_prompts", "log prompt text with each request (debugging only)"),
            _flag("--log-level", "server.log_level", str.upper, "DEBUG, INFO, WARNING or ERROR"),
            _flag("--tls-cert", "server.tls_cert", str,
                  "PEM certificate chain: serve TLS (needs --tls-key); unset: plaintext"),
            _flag("--tls-key", "server.tls_key", str, "PEM private key of --tls-cert"),
            _flag("--tls-client-ca", "server.tls_client_ca", str,
                  "PEM root certificates: require client certificates signed by them"),
            _flag("--max-receive-message-bytes", "server.max_receive_message_bytes", _positive_int,
                  "largest request message accepted; beyond it RESOURCE_EXHAUSTED"),
            _flag("--stream-stall-timeout", "server.stream_stall_timeout_s", _positive_float,
                  "seconds a Generate stream may wait on a client that reads nothing before it is aborted"),
            _flag("--keepalive-min-ping-interval", "server.keepalive_min_ping_interval_s", _positive_float,
                  "seconds: clients may send keepalive pings this often; more often gets GOAWAY too_many_pings"),
            _flag("--log-format", "server.log_format", _log_format,
                  "text (key=value, caller values quoted) or json"),
        ),
    ),
    (
        "authentication",
        (
            _flag("--auth-token-file", "server.auth_token_file", str,
                  "Kubernetes static token file (token,identity[,...] per line): GenerateService calls need "
                  "'authorization: Bearer <token>'; re-read on SIGHUP"),
            _switch("--identity-from-cert", "server.identity_from_cert",
                    "with --tls-client-ca: the caller's identity is its certificate's SAN (or CN)"),
            _switch("--reflection-requires-auth", "server.reflection_requires_auth",
                    "with authentication on, reflection needs it too"),
            _switch("--shared-prefix-cache", "server.shared_prefix_cache",
                    "with authentication on, share the prefix cache across identities (a common system prompt is "
                    "computed once, but a caller can tell from cached_prompt_tokens what others sent)"),
            _flag("--max-streams-per-identity", "server.max_streams_per_identity", _positive_int,
                  "Generate streams one identity may have in flight; beyond it RESOURCE_EXHAUSTED"),
            _flag("--admin-identity", "server.admin_identities", _identity,
                  "with authentication on, an identity (token file user or certificate name) that may call "
                  "AdapterService (load, unload, list adapters); others get PERMISSION_DENIED (repeatable)",
                  repeated=True, shown=_identities_text),
        ),
    ),
    (
        "input limits (INVALID_ARGUMENT beyond them)",
        (
            _flag("--max-request-id-length", "server.limits.max_request_id_length", _positive_int,
                  "characters of request_id"),
            _flag("--max-session-id-length", "server.limits.max_session_id_length", _positive_int,
                  "characters of session_id"),
            _flag("--max-stop-sequences", "server.limits.max_stop_sequences", _positive_int,
                  "stop sequences per request"),
            _flag("--max-stop-sequences-chars", "server.limits.max_stop_sequences_chars", _positive_int,
                  "characters of all stop sequences of a request together"),
            _flag("--max-stop-token-ids", "server.limits.max_stop_token_ids", _positive_int,
                  "stop token ids per request"),
            _flag("--max-chat-messages", "server.limits.max_chat_messages", _positive_int, "messages per chat input"),
            _flag("--chat-roles", "server.limits.chat_roles", _roles, "comma-separated roles a chat message may have",
                  shown=_roles_text),
            _flag("--max-prompt-bytes", "server.limits.max_prompt_bytes", _positive_int,
                  "UTF-8 bytes of a text or chat input, checked before tokenization; unset: 16 per token of context"),
            _flag("--max-top-logprobs", "engine.max_top_logprobs", _top_logprobs,
                  "largest response.top_logprobs"),
            _flag("--max-logit-bias", "server.limits.max_logit_bias", _positive_int,
                  "entries of sampling.logit_bias per request"),
            _flag("--max-constraint-chars", "server.limits.max_constraint_chars", _positive_int,
                  "characters of a request's constraint (JSON schema, regex, grammar, or all choices together)"),
            _flag("--max-embed-inputs", "server.limits.max_embed_inputs", _positive_int, "inputs of one Embed call"),
        ),
    ),
    (
        "operations",
        (
            _flag("--metrics-port", "server.metrics_port", _port,
                  "serve Prometheus metrics at :PORT/metrics (0: off)"),
            _flag("--replica-name", "server.replica_name", str,
                  "name returned in the x-llmserve-replica trailing metadata; unset: host name and port"),
            _switch("--tracing", "server.tracing",
                    "OpenTelemetry spans for Generate calls, exported as the OTEL_* variables say"),
        ),
    ),
    (
        "engine",
        (
            _flag("--kv-cache-tokens", "engine.kv_cache_tokens", _positive_int,
                  "KV cache size in tokens; unset: --kv-cache-memory-fraction of free memory"),
            _flag("--kv-cache-memory-fraction", "engine.kv_cache_memory_fraction", _fraction,
                  "share of free device memory (CUDA) or of the CPU budget for the KV cache"),
            _flag("--block-size", "engine.block_size", _positive_int, "tokens per KV cache block"),
            _flag("--max-num-seqs", "engine.max_num_seqs", _positive_int, "most sequences in one batch"),
            _flag("--max-num-batched-tokens", "engine.max_num_batched_tokens", _positive_int,
                  "most tokens in one forward (prefill chunks plus decodes)"),
            _flag("--max-model-len", "engine.max_model_len", _positive_int, "context length cap; unset: the model's"),
            _flag("--pooling-share", "engine.pooling_share", _fraction,
                  "while generation runs, the most of a step's cost that Embed/classify inputs on a generative model "
                  "may take (1: no bound); the streams keep about 1 - this of their rate beside any embedding load"),
            _flag("--pooling-step-tokens", "engine.pooling_step_tokens", _non_negative_int,
                  "a step's fixed cost in tokens of compute (F): beside G streams Embed inputs get "
                  "floor((G + F) share / (1 - share)) tokens a step; unset: measured at start"),
            _flag("--max-waiting", "engine.max_waiting", _positive_int,
                  "requests waiting in the engine queue; beyond it calls get RESOURCE_EXHAUSTED"),
            _switch("--no-prefix-caching", "engine.enable_prefix_caching", "turn off automatic prefix caching",
                    invert=True),
            _flag("--constraint-compile-timeout", "engine.constraint_compile_timeout_s", _positive_float,
                  "seconds a request's constraint may take to compile; beyond it INVALID_ARGUMENT"),
            _flag("--constraint-cache-size", "engine.constraint_cache_size", _positive_int,
                  "compiled constraints kept (least recently used dropped first)"),
            # 16: one call then fills at most a quarter of the default batch (--max-num-seqs 64), so that one caller
            # cannot crowd out the others, and best-of-n uses rarely go past 8-16.
            _flag("--max-n", "engine.max_n", _positive_int,
                  "most completions one Generate call may ask for (n); beyond it INVALID_ARGUMENT"),
            _flag("--speculative", "engine.speculative", _one_of("ngram", "suffix", "off"),
                  "speculative decoding without a draft model: ngram (prompt lookup), suffix (suffix trees over the "
                  "context and the identity's earlier answers), off; the load rule turns it off where it does not pay"),
            _flag("--speculative-max-k", "engine.speculative_max_k", _positive_int,
                  "most drafts a sequence verifies in one step (the load rule gives fewer as the batch grows)"),
            _flag("--speculative-cost-table", "engine.speculative_cost_table", str,
                  "JSON step-cost table for the load rule (rows of batch, k, forward_ms) instead of measuring it at "
                  "start-up"),
            _switch("--async-scheduling", "engine.async_scheduling",
                    "overlap: plan and launch the next step while the current one runs (off: speculative decoding, "
                    "KV offload); default off until measured on a GPU"),
            _flag("--kv-offload-gib", "engine.kv_offload_bytes", _non_negative_float,
                  "host memory for KV blocks the pool evicts (reloaded on a later prefix or session match); 0: off",
                  to_field=_gib_to_bytes, from_field=_bytes_to_gib),
            _flag("--kv-offload-dir", "engine.kv_offload_dir", str,
                  "folder for a disk tier of evicted KV blocks (kept across restarts, per model); unset: off"),
            _flag("--kv-offload-disk-gib", "engine.kv_offload_disk_bytes", _positive_float,
                  "most KV payload the disk tier keeps in GiB (least recently used deleted first)",
                  to_field=_gib_to_bytes, from_field=_bytes_to_gib),
            _flag("--cpu-kernels", "engine.cpu_kernels", _one_of("auto", "require", "off"),
                  "CPU backend's compiled kernels (built at install time): auto (use them where installed, else "
                  "warn and run the torch paths), require (refuse to start without them), off"),
        ),
    ),
    (
        "LoRA adapters",
        (
            _switch("--enable-lora", "engine.enable_lora",
                    "serve LoRA adapters (GenerateRequest.adapter; AdapterService loads them at run time)"),
            _flag("--lora", "engine.loras", _named_path,
                  "NAME=PATH: read the PEFT adapter folder PATH at start, served as NAME (repeatable; implies "
                  "--enable-lora)", repeated=True, shown=_named_paths_text),
            _flag("--max-loras", "engine.max_loras", _positive_int, "most distinct adapters in one engine step"),
            _flag("--max-lora-rank", "engine.max_lora_rank", _lora_rank,
                  "largest adapter rank served; a higher one is refused at load"),
            _flag("--max-cpu-loras", "engine.max_cpu_loras", _positive_int,
                  "adapters kept in host memory (least recently used idle one unloaded first); unset: the larger "
                  "of --max-loras and the number of --lora"),
        ),
    ),
    (
        "sessions",
        (
            _flag("--session-ttl", ("engine.session_ttl_s", "server.history.ttl_s"), _non_negative_float,
                  "seconds an idle session's cache and history are kept"),
            _flag("--max-sessions", ("engine.max_sessions", "server.history.max_sessions"), _positive_int,
                  "most sessions kept (caches and, counted apart, histories)"),
            _flag("--session-pool-fraction", "engine.session_pool_fraction", _fraction,
                  "largest share of the KV cache idle sessions may hold"),
            _flag("--max-session-tokens", "server.history.max_tokens", _positive_int,
                  "most tokens a session's history may hold; a longer continued prompt is INVALID_ARGUMENT; "
                  "unset: the context"),
            _flag("--session-history-mib", "server.history.max_bytes", _positive_float,
                  "cap of all held session histories in MiB, as the store holds them (least recently used "
                  "evicted first)", to_field=_mib_to_bytes, from_field=_bytes_to_mib),
            _flag("--history-store", "server.history.store", check_store_spec,
                  "where session histories live: memory (this process), sqlite:PATH (survives restarts), "
                  "redis://HOST:PORT/DB (shared by replicas); unset: sqlite:<cache dir>/sessions.sqlite3"),
            _switch("--history-store-optional", "server.history.optional",
                    "start even when the history store does not answer (calls with a session id fail UNAVAILABLE "
                    "until it does); without it the server exits with status 2"),
            _flag("--history-lease", "server.history.lease_s", _positive_float,
                  "seconds a continuing call's lock on its session outlives the call's last renewal (sqlite, "
                  "redis): the longest a crashed replica blocks a session"),
        ),
    ),
    (
        "debugging (kernel A/B switches)",
        (
            _switch("--no-cuda-graphs", "engine.cuda_graphs", "turn off CUDA graphs for the decode step",
                    invert=True),
            _flag("--attention-kernel", "engine.attention_kernel", _one_of("auto", "triton", "torch"),
                  "CUDA attention: triton (one varlen paged kernel per layer), torch (gathered decode groups, SDPA "
                  "per prompt chunk), auto (triton where installed)"),
            _flag("--mixed-steps", "engine.mixed_steps", _one_of("eager", "compile", "compile-graphs"),
                  "CUDA steps mixing prompt chunks with decodes: eager, compile (torch.compile piecewise around "
                  "attention), compile-graphs (those pieces in CUDA graphs); the first step of each shape compiles"),
            _switch("--no-native-attention", "engine.native_attention",
                    "CPU: decode attention through torch instead of the compiled kernel", invert=True),
            _switch("--no-packed-linear", "engine.packed_linear",
                    "CPU float32: plain linear layers instead of packed oneDNN weights", invert=True),
            _switch("--no-fused-layers", "engine.fused_layers",
                    "CPU: transformers' own layer forward instead of the fused one (Llama family)", invert=True),
            _switch("--no-compiled-steps", "engine.compiled_steps",
                    "CPU, a GGUF's blocks: every step through the fused forward's Python loop instead of one C call "
                    "(the same kernels and results)", invert=True),
        ),
    ),
)  # fmt: skip
