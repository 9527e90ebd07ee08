"""Flags and LLMSERVE_* environment variables -> Config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from llmserve.config import DEFAULT_ADDRESS, Config, from_args
from llmserve.engine.config import EngineConfig


def test_defaults() -> None:
    config = from_args([], env={})
    # The one default from_args fills in (the dataclass's None is memory, for in-process servers): histories in a
    # file of the cache directory.
    home_store = f"sqlite:{Path.home() / '.cache' / 'llmserve' / 'sessions.sqlite3'}"
    assert config.server.history.store == home_store
    history = dataclasses.replace(config.server.history, store=None)
    assert dataclasses.replace(config, server=dataclasses.replace(config.server, history=history)) == Config()
    assert config.server.address == DEFAULT_ADDRESS == "0.0.0.0:50051"
    assert config.server.reflection and not config.server.log_prompts
    assert config.engine == EngineConfig()


def test_flags() -> None:
    config = from_args(
        [
            "--model", "/models/x.gguf", "--device", "cuda:1", "--dtype", "bfloat16",
            "--address", "127.0.0.1:6000",
            "--kv-cache-tokens", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
            "--block-size", "32", "--session-ttl", "60", "--max-sessions", "10", "--session-pool-fraction", "0.5",
            "--pooling-share", "0.5", "--pooling-step-tokens", "7", "--no-prefix-caching",
            "--max-concurrent-streams", "3", "--grace-period", "2.5",
            "--log-prompts", "--no-reflection", "--no-cuda-graphs", "--no-native-attention", "--no-packed-linear",
            "--fp32-matmul", "ieee",
        ],
        env={},
    )  # fmt: skip
    assert config.model.spec == "/models/x.gguf"
    assert (config.model.device, config.model.dtype, config.model.fp32_matmul) == ("cuda:1", "bfloat16", "ieee")
    assert from_args([], env={}).model.fp32_matmul == "auto"
    assert config.server.address == "127.0.0.1:6000"
    assert config.server.max_concurrent_streams == 3
    assert config.server.grace_period_s == 2.5
    assert config.server.log_prompts and not config.server.reflection
    e = config.engine
    assert (e.kv_cache_tokens, e.max_num_seqs, e.max_num_batched_tokens, e.block_size) == (4096, 8, 256, 32)
    assert (e.session_ttl_s, e.max_sessions, e.session_pool_fraction, e.pooling_share) == (60.0, 10, 0.5, 0.5)
    assert e.pooling_step_tokens == 7
    assert not e.enable_prefix_caching and not e.cuda_graphs
    assert not e.native_attention and not e.packed_linear


def test_the_address_is_one_flag_and_checked() -> None:
    """One way to say where to listen: --address host:port (LLMSERVE_ADDRESS); a malformed one is refused."""
    assert from_args(["--address", "[::1]:7000"], env={}).server.address == "[::1]:7000"
    assert from_args([], env={"LLMSERVE_ADDRESS": "127.0.0.1:0"}).server.address == "127.0.0.1:0"
    for bad in ("50051", "localhost", ":50051", "::1:50051", "h:70000", "h:x"):
        with pytest.raises(SystemExit):
            from_args(["--address", bad], env={})
    with pytest.raises(SystemExit):
        from_args(["--port", "1"], env={})


def test_environment_variables_and_flags_over_them() -> None:
    env = {"LLMSERVE_MAX_NUM_SEQS": "4", "LLMSERVE_NO_REFLECTION": "true", "LLMSERVE_ADDRESS": "127.0.0.1:7001"}
    config = from_args([], env=env)
    assert config.engine.max_num_seqs == 4
    assert not config.server.reflection
    assert config.server.address.endswith(":7001")
    assert from_args(["--max-num-seqs", "9"], env=env).engine.max_num_seqs == 9


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--max-num-seqs", "0"], {}),
        (["--session-pool-fraction", "1.5"], {}),
        (["--pooling-share", "0"], {}),
        (["--pooling-step-tokens", "-1"], {}),
        (["--grace-period", "-1"], {}),
        ([], {"LLMSERVE_MAX_NUM_SEQS": "many"}),
        ([], {"LLMSERVE_NO_REFLECTION": "perhaps"}),
    ],
)
def test_bad_values_are_refused(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(SystemExit):
        from_args(argv, env=env)


def test_tls_flags() -> None:
    config = from_args(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"], env={})
    assert (config.server.tls_cert, config.server.tls_key, config.server.tls_client_ca) == ("c.pem", "k.pem", "ca.pem")
    with pytest.raises(SystemExit):
        from_args(["--tls-cert", "c.pem"], env={})
    with pytest.raises(SystemExit):
        from_args(["--tls-client-ca", "ca.pem"], env={})


def leaf_fields(obj: object, prefix: str = "") -> dict[str, object]:
    """Every setting of a config dataclass tree: dotted path -> default."""
    import dataclasses

    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaf_fields(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def test_every_setting_is_one_flag_whose_default_is_the_fields() -> None:
    """Each flag is declared once (llmserve.flags.FLAGS): every config field is set by exactly one flag, except
    the few that are not flags on purpose, and the parser's default is the dataclass's own."""
    from llmserve.config import all_flags, build_parser

    not_flags = {"engine.cpu_kv_cache_bytes": "a fixed budget"}
    settings = leaf_fields(Config())
    targets = [t for flag in all_flags() for t in flag.targets]
    assert sorted(t for t in set(targets) if targets.count(t) > 1) == []
    assert set(settings) - set(targets) == set(not_flags)
    assert set(targets) <= set(settings)
    names = [flag.name for flag in all_flags()]
    assert len(names) == len(set(names))
    parser = build_parser({})
    defaults = {a.option_strings[0]: a.default for a in parser._actions if a.option_strings}
    for flag in all_flags():
        for target in flag.targets:
            expected = settings[target]
            if flag.invert:
                expected = not expected
            elif flag.from_field is not None:
                expected = flag.from_field(expected)
            assert defaults[flag.name] == expected, flag.name
    assert from_args(["--session-history-mib", "2"], env={}).server.history.max_bytes == 2 << 20
    both = from_args(["--session-ttl", "7", "--max-sessions", "3"], env={})
    assert (both.engine.session_ttl_s, both.server.history.ttl_s) == (7.0, 7.0)
    assert (both.engine.max_sessions, both.server.history.max_sessions) == (3, 3)
    env = {"LLMSERVE_NO_FUSED_LAYERS": "1", "LLMSERVE_CHAT_ROLES": "user"}
    assert not from_args([], env=env).engine.fused_layers and from_args([], env=env).server.limits.chat_roles == (
        "user",
    )


def test_history_store_flags() -> None:
    h = from_args([], env={"LLMSERVE_CACHE_DIR": "/data/cache"}).server.history
    assert (h.store, h.optional, h.lease_s) == ("sqlite:/data/cache/sessions.sqlite3", False, 10.0)
    argv = ["--history-store", "redis://10.0.0.5:6379/2", "--history-store-optional", "--history-lease", "3"]
    h = from_args(argv, env={}).server.history
    assert (h.store, h.optional, h.lease_s) == ("redis://10.0.0.5:6379/2", True, 3.0)
    assert from_args([], env={"LLMSERVE_HISTORY_STORE": "memory"}).server.history.store == "memory"
    for bad in ("sqlite:", "postgres://x", "mem"):
        with pytest.raises(SystemExit):
            from_args(["--history-store", bad], env={})


def test_lora_flags() -> None:
    """--lora is repeatable (NAME=PATH; the environment's comma-separated values give way to the command line's)
    and turns LoRA on; the bounds are checked against each other at start."""
    off = from_args([], env={}).engine
    assert (off.lora_enabled, off.loras, off.max_loras, off.max_lora_rank, off.cpu_loras) == (False, (), 4, 16, 4)
    argv = ["--lora", "sql=/a/sql", "--lora", "chat=/a/chat", "--max-loras", "1", "--max-lora-rank", "64"]
    on = from_args(argv, env={"LLMSERVE_LORA": "other=/x"}).engine
    assert on.loras == (("sql", "/a/sql"), ("chat", "/a/chat")) and on.lora_enabled
    assert (on.max_loras, on.max_lora_rank, on.cpu_loras) == (1, 64, 2)
    assert from_args([], env={"LLMSERVE_LORA": "a=/x,b=/y"}).engine.loras == (("a", "/x"), ("b", "/y"))
    assert from_args(["--enable-lora"], env={}).engine.lora_enabled
    admins = from_args(["--admin-identity", "ops", "--admin-identity", "ci"], env={}).server.admin_identities
    assert admins == ("ops", "ci")
    for bad in (
        ["--lora", "noequals"],
        ["--lora", "a b=/x"],
        ["--lora", "a=/x", "--lora", "a=/y"],
        ["--max-lora-rank", "0"],
        ["--max-lora-rank", "1000"],
        ["--max-loras", "4", "--max-cpu-loras", "2"],
        ["--lora", "a=/x", "--lora", "b=/y", "--max-loras", "1", "--max-cpu-loras", "1"],
    ):
        with pytest.raises(SystemExit):
            from_args(bad, env={})
