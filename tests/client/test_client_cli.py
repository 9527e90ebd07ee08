"""The client CLI as a subprocess, against a real in-process server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from harness import ServerThread

from llmserve_client import Client


def cli(server: ServerThread, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "llmserve_client", "--address", server.address, "--timeout", "60", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def test_generate_prints_the_completion(server: ServerThread) -> None:
    out = cli(server, "generate", "Once upon a time", "--max-new-tokens", "10", "--ignore-eos", "--stats")
    assert out.returncode == 0, out.stderr
    with Client(server.address, timeout=30) as client:
        expected = client.generate_text("Once upon a time", max_new_tokens=10, ignore_eos=True)
    assert out.stdout == expected + "\n"
    assert "finish=length" in out.stderr and "completion_tokens=10" in out.stderr


def test_generate_streams_before_the_answer_is_complete(server: ServerThread) -> None:
    cmd = [sys.executable, "-m", "llmserve_client", "--address", server.address]
    cmd += ["generate", "Once upon a time", "--max-new-tokens", "900", "--ignore-eos"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = os.read(proc.stdout.fileno(), 1)  # blocks until the first text arrives
        assert first
        assert proc.poll() is None, "text arrived before generation ended"
        assert server.engine.num_running == 1
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while server.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.num_running == 0, "a killed client's request is aborted"


def test_generate_json_prints_one_message_per_line(server: ServerThread) -> None:
    out = cli(server, "generate", "What is the capital of France?", "--chat", "--max-new-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr
    messages = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(messages) >= 2
    assert messages[-1]["finish_reason"].startswith("FINISH_REASON_")
    assert messages[-1]["usage"]["prompt_tokens"] > 8  # the chat template's tokens are in the prompt


def test_health_model_info_tokenize(server: ServerThread) -> None:
    out = cli(server, "health")
    assert (out.returncode, out.stdout) == (0, "SERVING\n")
    out = cli(server, "model-info")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["vocab_size"] == 49152
    out = cli(server, "tokenize", "Hello world")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"token_ids": [19556, 905]}


def test_errors_exit_one_with_the_status(server: ServerThread) -> None:
    out = cli(server, "generate", "hi", "--temperature", "-1")
    assert out.returncode == 1
    assert "INVALID_ARGUMENT: sampling.temperature" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "llmserve_client", "--address", "127.0.0.1:1", "--timeout", "2", "health"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert "UNAVAILABLE" in out.stderr or "DEADLINE_EXCEEDED" in out.stderr


def test_generate_with_a_json_schema_file_a_regex_or_a_choice(server: ServerThread, tmp_path) -> None:  # noqa: ANN001
    import re

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    out = cli(server, "generate", "Answer:", "--json-schema", str(path), "--max-new-tokens", "40", "--stats")
    assert out.returncode == 0, out.stderr
    assert "finish=constraint" in out.stderr
    value = json.loads(out.stdout)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    out = cli(server, "generate", "Year:", "--regex", "19[0-9]{2}", "--temperature", "1", "--seed", "3")
    assert out.returncode == 0 and re.fullmatch("19[0-9]{2}\n", out.stdout), out
    out = cli(
        server, "generate", "Colour:", "--choice", "red,green,blue", "--logit-bias", "5=-100", "--presence-penalty", "1"
    )
    assert out.returncode == 0 and out.stdout in ("red\n", "green\n", "blue\n"), out
    out = cli(server, "generate", "Bad:", "--regex", "[0-")
    assert out.returncode == 1 and "INVALID_ARGUMENT: constraint.regex:" in out.stderr


def test_generate_n_prints_each_completion_by_index(server: ServerThread) -> None:
    options = ["--max-new-tokens", "6", "--ignore-eos", "--temperature", "1.0", "--seed", "9"]
    out = cli(server, "generate", "Once upon a time", "--n", "3", "--stats", *options)
    assert out.returncode == 0, out.stderr
    with Client(server.address, timeout=30) as client:
        texts = client.generate_texts(
            "Once upon a time", n=3, max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=9
        )
        alone = client.generate_text("Once upon a time", max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=11)
    assert len(texts) == 3 and texts[2] == alone  # completion 2 samples with seed 9 + 2
    for i, text in enumerate(texts):
        assert f"[{i}] {text}" in out.stdout
    assert out.stderr.count("completion_tokens=6") == 3 and "total prompt_tokens=" in out.stderr
    assert "completion_tokens=18" in out.stderr


def test_adapters_and_generate_with_one(tmp_path) -> None:  # noqa: ANN001
    """`adapters load|list|unload` and `generate --adapter` against a server that serves LoRA adapters."""
    from harness import tiny_engine, tiny_model

    from tests.engine.lora.peft_adapters import make_adapter

    folder = make_adapter(tiny_model().model, tmp_path / "sql", seed=1, merge=False, r=4).folder
    srv = ServerThread(tiny_engine(in_process=True, enable_lora=True)).start()
    try:
        out = cli(srv, "adapters", "load", "sql", str(folder))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["rank"] == 4
        assert [a["name"] for a in json.loads(cli(srv, "adapters", "list").stdout)["adapters"]] == ["sql"]
        out = cli(srv, "generate", "Once upon a time", "--max-new-tokens", "6", "--ignore-eos", "--adapter", "sql")
        assert out.returncode == 0, out.stderr
        with Client(srv.address, timeout=30) as client:
            assert out.stdout == client.generate_text("Once upon a time", max_new_tokens=6, ignore_eos=True,
                                                      adapter="sql") + "\n"  # fmt: skip
            base = client.generate_text("Once upon a time", max_new_tokens=6, ignore_eos=True)
        assert out.stdout != base + "\n", "the adapter changed nothing"
        out = cli(srv, "generate", "Hi", "--adapter", "nope")
        assert out.returncode == 1 and "NOT_FOUND" in out.stderr and "adapter" in out.stderr
        assert json.loads(cli(srv, "adapters", "unload", "sql").stdout) == {"draining_requests": 0}
    finally:
        srv.stop()
