"""The CLI sends a bearer token from --token, $LLMSERVE_TOKEN or a token file on every call."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from harness import ServerThread

from llmserve_client.auth import resolve_token

TOKEN = "cli-token-0123456789"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tokens = tmp_path_factory.mktemp("cli-auth") / "tokens.csv"
    tokens.write_text(f"{TOKEN},cli-user\n")
    srv = ServerThread(FakeEngine(), auth_token_file=str(tokens)).start()
    yield srv
    srv.stop()


def _cli(server: ServerThread, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_TOKEN")}
    cmd = [sys.executable, "-m", "llmserve_client", "--address", server.address, "--timeout", "30", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def test_cli_token_from_flag_env_or_file(auth_server: ServerThread, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    ways: list[tuple[tuple[str, ...], dict[str, str]]] = [
        (("--token", TOKEN), {}),
        ((), {"LLMSERVE_TOKEN": TOKEN}),
        (("--token-file", str(token_file)), {}),
        ((), {"LLMSERVE_TOKEN_FILE": str(token_file)}),
    ]
    for flags, env in ways:
        out = _cli(auth_server, *flags, "generate", "hi", "--max-new-tokens", "3", env=env)
        assert out.returncode == 0, (flags, env, out.stderr)
        assert _cli(auth_server, *flags, "model-info", env=env).returncode == 0
    out = _cli(auth_server, "generate", "hi")
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
    out = _cli(auth_server, "--token", "wrong", "tokenize", "hi")
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
    assert _cli(auth_server, "health").returncode == 0, "health needs no token"


def test_token_precedence(tmp_path: Path) -> None:
    file = tmp_path / "t"
    file.write_text("from-file")
    assert resolve_token("flag", file, env={"LLMSERVE_TOKEN": "env"}) == "flag"
    assert resolve_token(None, file, env={"LLMSERVE_TOKEN": "env"}) == "from-file"
    assert resolve_token(None, None, env={"LLMSERVE_TOKEN": "env", "LLMSERVE_TOKEN_FILE": str(file)}) == "env"
    assert resolve_token(None, None, env={"LLMSERVE_TOKEN_FILE": str(file)}) == "from-file"
    assert resolve_token(None, None, env={}) is None
