"""`llmserve-client chat` and `generate --continue` as subprocesses against a real in-process server (tiny model):
each turn's answer is what resending the whole conversation gives."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest
from harness import ServerThread

from llmserve_client import Client


def cli(server: ServerThread, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "llmserve_client", "--address", server.address, "--timeout", "60", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)


def resend(server: ServerThread, messages: list[tuple[str, str]], max_new_tokens: int = 6) -> str:
    with Client(server.address, timeout=60) as client:
        return client.generate_text(messages=messages, max_new_tokens=max_new_tokens)


def test_piped_chat_one_turn_per_line_with_commands(server: ServerThread) -> None:
    lines = ["Hello there.", "/stats", "What did I say?", "/reset", "Hi", "/system Be brief.", "Hello"]
    out = cli(server, "chat", "--session", "cli-1", "--max-new-tokens", "6", stdin="\n".join(lines) + "\n")
    assert out.returncode == 0, out.stderr
    a1 = resend(server, [("user", "Hello there.")])
    a2 = resend(server, [("user", "Hello there."), ("assistant", a1), ("user", "What did I say?")])
    a3 = resend(server, [("user", "Hi")])
    a4 = resend(server, [("system", "Be brief."), ("user", "Hello")])
    assert out.stdout == f"{a1}\n{a2}\n{a3}\n{a4}\n"
    assert "session cli-1: history 1 turns" in out.stderr

    # The same session id again resumes the conversation the server holds.
    out = cli(server, "chat", "--session", "cli-1", "--max-new-tokens", "6", stdin="More\n")
    assert out.returncode == 0, out.stderr
    assert "continuing session cli-1" in out.stderr
    a5 = resend(server, [("system", "Be brief."), ("user", "Hello"), ("assistant", a4), ("user", "More")])
    assert out.stdout == a5 + "\n"


def test_generated_session_id_and_errors_exit_one(server: ServerThread) -> None:
    out = cli(server, "chat", "--max-new-tokens", "4", "--stats", stdin="Hello\n")
    assert out.returncode == 0, out.stderr
    assert "[session chat-" in out.stderr and "finish=" in out.stderr
    out = cli(server, "chat", "--max-new-tokens", "0", stdin="Hello\n")
    assert out.returncode == 1 and "INVALID_ARGUMENT: stopping.max_new_tokens" in out.stderr


def test_generate_continue(server: ServerThread) -> None:
    first = cli(server, "generate", "My name is Ana.", "--chat", "--session", "gen-ana", "--max-new-tokens", "6")
    assert first.returncode == 0, first.stderr
    args = ["generate", "What is my name?", "--chat", "--session", "gen-ana", "--continue", "--max-new-tokens", "6"]
    second = cli(server, *args, "--stats")
    assert second.returncode == 0, second.stderr
    a1 = first.stdout.removesuffix("\n")
    assert (
        second.stdout
        == resend(server, [("user", "My name is Ana."), ("assistant", a1), ("user", "What is my name?")]) + "\n"
    )
    assert "cached=0 " not in second.stderr
    missing = cli(server, "generate", "hi", "--session", "gen-nobody", "--continue")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    usage = cli(server, "generate", "hi", "--continue")
    assert usage.returncode == 2 and "--continue needs --session" in usage.stderr


def test_interactive_chat_on_a_terminal(server: ServerThread) -> None:
    """On a terminal the prompt is shown, lines are edited with readline, the answer streams, Ctrl-D leaves."""
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "llmserve_client", "--address", server.address, "--timeout", "60"]
    proc = subprocess.Popen(
        [*cmd, "chat", "--session", "tty-1", "--max-new-tokens", "6"],
        stdin=slave,
        stdout=slave,
        stderr=subprocess.PIPE,
    )
    os.close(slave)
    expected = resend(server, [("user", "Hello")])
    seen = b""

    def read_until(marker: bytes, timeout: float = 60) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while marker not in seen and time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                seen += os.read(master, 4096)
        assert marker in seen, seen

    try:
        read_until(b"> ")
        os.write(master, b"ello\x01H\r")  # Ctrl-A: readline's start of line, where H goes
        read_until(expected.encode().replace(b"\n", b"\r\n") + b"\r\n> ")
        os.write(master, b"\x04")  # Ctrl-D at an empty prompt
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        os.close(master)
    with Client(server.address, timeout=60) as client:
        assert client.get_session("tty-1").history_turns == 1


@pytest.mark.real_model
def test_real_model_chat_remembers_the_name() -> None:
    """The issue's example on the default model: the second answer names Ana and equals the full resend's."""
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.frontend.async_engine import AsyncEngine
    from llmserve.models.loader import load_model

    engine = AsyncEngine(load_model(), EngineConfig(kv_cache_tokens=2048, max_num_seqs=4, cuda_graphs=False))
    srv = ServerThread(engine).start()
    try:
        turns = ["My name is Ana.", "What is my name? Reply with just the name."]
        out = cli(srv, "chat", "--max-new-tokens", "48", stdin="\n".join(turns) + "\n")
        assert out.returncode == 0, out.stderr
        first = resend(srv, [("user", turns[0])], max_new_tokens=48)
        second = resend(srv, [("user", turns[0]), ("assistant", first), ("user", turns[1])], max_new_tokens=48)
        assert "Ana" in second
        assert out.stdout == f"{first}\n{second}\n"
    finally:
        srv.stop()
