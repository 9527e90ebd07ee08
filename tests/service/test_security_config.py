"""The security and limit flags -> ServerConfig."""

from __future__ import annotations

import pytest

from llmserve.config import InputLimits, from_args


def test_defaults_are_off_and_bounded() -> None:
    server = from_args([], env={}).server
    assert not server.auth_enabled
    assert (server.auth_token_file, server.identity_from_cert, server.reflection_requires_auth) == (None, False, False)
    assert not server.shared_prefix_cache and server.max_streams_per_identity is None
    assert server.limits == InputLimits()
    assert server.limits.chat_roles == ("system", "user", "assistant", "tool")
    assert (server.max_receive_message_bytes, server.stream_stall_timeout_s) == (4 << 20, 30.0)
    assert server.log_format == "text"


def test_flags_and_environment() -> None:
    config = from_args(
        [
            "--auth-token-file", "/etc/tokens.csv", "--reflection-requires-auth", "--shared-prefix-cache",
            "--max-streams-per-identity", "4", "--max-receive-message-bytes", "65536", "--stream-stall-timeout", "5",
            "--keepalive-min-ping-interval", "2", "--log-format", "JSON", "--max-request-id-length", "64",
            "--max-session-id-length", "32", "--max-stop-sequences", "4", "--max-stop-sequences-chars", "100",
            "--max-stop-token-ids", "8", "--max-chat-messages", "10", "--chat-roles", "user, assistant",
            "--max-prompt-bytes", "1000", "--max-top-logprobs", "5",
        ],
        env={},
    )  # fmt: skip
    s = config.server
    assert s.auth_enabled and s.auth_token_file == "/etc/tokens.csv"
    assert s.reflection_requires_auth and s.shared_prefix_cache and s.max_streams_per_identity == 4
    assert (s.max_receive_message_bytes, s.stream_stall_timeout_s, s.keepalive_min_ping_interval_s) == (65536, 5, 2)
    assert s.log_format == "json"
    assert s.limits == InputLimits(64, 32, 4, 100, 8, 10, ("user", "assistant"), 1000)
    assert config.engine.max_top_logprobs == 5  # a value bound: the engine's request check applies it
    env = {"LLMSERVE_AUTH_TOKEN_FILE": "/t.csv", "LLMSERVE_MAX_PROMPT_BYTES": "77", "LLMSERVE_CHAT_ROLES": "a,b"}
    s = from_args([], env=env).server
    assert (s.auth_token_file, s.limits.max_prompt_bytes, s.limits.chat_roles) == ("/t.csv", 77, ("a", "b"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--identity-from-cert"],  # needs --tls-client-ca
        [
            "--tls-cert",
            "c",
            "--tls-key",
            "k",
            "--tls-client-ca",
            "ca",
            "--identity-from-cert",
            "--auth-token-file",
            "t",
        ],  # noqa: E501
        ["--max-top-logprobs", "21"],
        ["--log-format", "xml"],
        ["--chat-roles", " , "],
        ["--stream-stall-timeout", "0"],
        ["--max-streams-per-identity", "0"],
    ],
)
def test_bad_combinations_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        from_args(argv, env={})


def test_identity_from_cert_with_client_ca() -> None:
    s = from_args(["--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "ca", "--identity-from-cert"], env={}).server
    assert s.identity_from_cert and s.auth_enabled
