"""deploy/image/build.py without a container engine: the pip configuration it hands the build (read by the real pip,
from a configuration file and PIP_* variables made here) and the podman command it runs. `make image-test` runs it
for real (minutes; podman)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_build() -> ModuleType:
    """deploy/image/build.py as a module (deploy/ is not a package: `make image` runs the file itself)."""
    spec = importlib.util.spec_from_file_location("image_build", ROOT / "deploy" / "image" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


build = load_build()
PIP = [sys.executable, "-m", "pip"]


def pip_env(tmp_path: Path, config: str, **variables: str) -> dict[str, str]:
    """An environment whose pip reads `config` (with this machine's global files, which pip always reads) and
    `variables`, and none of this process's PIP_* variables."""
    (tmp_path / "pip.conf").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": str(tmp_path / "pip.conf"), **variables}


@pytest.fixture
def local(tmp_path: Path) -> Path:
    """Local things a pip configuration names: a certificate, a find-links folder, a PEP 503 index."""
    (tmp_path / "ca.pem").write_text("certificate\n")
    (tmp_path / "wheels").mkdir()
    (tmp_path / "index" / "simple").mkdir(parents=True)
    (tmp_path / "index" / "files").mkdir()
    return tmp_path


def test_local_paths_move_under_their_mount_and_the_rest_stays(local: Path) -> None:
    config = (
        "[global]\n"
        f"cert = {local}/ca.pem\n"
        f"extra-index-url = file://{local}/index/simple https://example.org/simple\n"
        f"constraint = {local}/missing.txt\n"
        "default-timeout = 3\n"
        "[install]\n"
        "no-compile = yes\n"
    )
    env = pip_env(local, config, PIP_FIND_LINKS=str(local / "wheels"), PIP_DEFAULT_TIMEOUT="7")
    pip = build.PipConfig.of(PIP, env)
    host = build.HOST_PIP
    assert f"cert = {host}{local}/ca.pem\n" in pip.text
    assert f"extra-index-url = file://{host}{local}/index/simple https://example.org/simple\n" in pip.text
    assert f"find-links = {host}{local}/wheels\n" in pip.text, "a PIP_* variable's setting"
    assert f"constraint = {local}/missing.txt\n" in pip.text, "a path that is not here is left as it is"
    assert "default-timeout = 7\n" in pip.text, "the variable wins over the file, as in pip"
    assert "[install]\nno-compile = yes\n" in pip.text
    # The index's folder (its pages link to ../../files/...), not only simple/; nothing that is not here.
    assert {local / "ca.pem", local / "index", local / "wheels"} <= set(pip.mounts)
    assert all(path.exists() for path in pip.mounts) and local / "missing.txt" not in pip.mounts


def test_pip_reads_the_merged_file_as_the_build_will(local: Path, tmp_path: Path) -> None:
    env = pip_env(local, f"[global]\nfind-links = {local}/wheels\n", PIP_DEFAULT_TIMEOUT="7")
    merged = tmp_path / "build"
    merged.mkdir()
    volumes = build.PipConfig.of(PIP, env).volumes(merged)
    assert f"--volume={merged}/pip.conf:{build.HOST_PIP}/pip.conf:ro" in volumes
    assert f"--volume={local}/wheels:{build.HOST_PIP}{local}/wheels:ro" in volumes
    seen = subprocess.run(
        [*PIP, "config", "list"],
        env={**pip_env(tmp_path, ""), "PIP_CONFIG_FILE": str(merged / "pip.conf")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"global.find-links='{build.HOST_PIP}{local}/wheels'" in seen
    assert "global.default-timeout='7'" in seen


def test_the_podman_build_has_the_settings_podman_needs_here(local: Path, tmp_path: Path) -> None:
    pip = build.PipConfig.of(PIP, pip_env(local, f"[global]\nfind-links = {local}/wheels\n"))
    command = build.podman_build("llmserve:cpu", build.LOCAL_BASE, "torch==2.13.0", pip, tmp_path)
    text = " ".join(command)
    assert command[:2] == ["podman", "build"]
    for setting in ("--isolation chroot", "--network host", "--format docker", "--tag llmserve:cpu"):
        assert setting in text, setting
    for arg in ("VARIANT=cpu", f"PYTHON_IMAGE={build.LOCAL_BASE}", "TORCH_SPEC=torch==2.13.0"):
        assert f"--build-arg {arg}" in text, arg
    assert f"--build-arg PIP_CONFIG_FILE={build.HOST_PIP}/pip.conf" in text
    assert command[-1] == str(ROOT)
    docker = build.docker_build("llmserve:cpu", None)
    assert "--build-arg VARIANT=cpu" in " ".join(docker) and "PYTHON_IMAGE" not in " ".join(docker)
