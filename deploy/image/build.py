"""Builds llmserve's CPU image (the Dockerfile's VARIANT=cpu): `make image`, `make image-test`.

With docker where a daemon answers, on the Dockerfile's default base (python:3.11-slim-bookworm). Otherwise with
podman, on a Debian bookworm base made here when it is missing (no image registry need be reachable), in the ways
podman needs on the development machines (Debian bookworm, root, cgroups in hybrid mode):
- the base: `debootstrap --variant=minbase bookworm` from the Debian mirror apt already uses, imported as
  localhost/debian:bookworm (about 40 s);
- CONTAINERS_CONF points at deploy/image/containers.conf (podman's default container limits fail there);
- `--isolation chroot --network host`, so that RUN steps run and reach the package registries;
- pip inside the build reaches the registries as this machine's pip does: every setting `pip config list` shows
  (its configuration files and PIP_* variables) goes into one file that the build's pip reads (PIP_CONFIG_FILE), and
  every local file or folder those settings name (certificate bundle, constraints, find-links folders, file://
  indexes) is mounted read-only under HOST_PIP for the RUN steps; torch is the one this machine's `make install`
  installs (TORCH_SPEC), which that configuration resolves (here: the local CPU wheel);
- `--format docker`: the OCI image format has no HEALTHCHECK.
podman, runc and debootstrap come from Debian's packages: `apt-get install podman runc debootstrap`.

Standard library only: `make image` runs it with the system's python3, before any venv exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = Path(__file__).resolve().parent / "containers.conf"
LOCAL_BASE = "localhost/debian:bookworm"
FALLBACK_MIRROR = "http://deb.debian.org/debian/"
# Where the build sees this machine's pip configuration and the local paths it names: under a folder of its own, so
# that none shadows a file of the image (the certificate bundle that Debian's ca-certificates writes in the build
# is such a file: dpkg fails on it, "Device or resource busy").
HOST_PIP = "/run/llmserve-host-pip"
INSTALL_HINT = "apt-get install podman runc debootstrap"


def podman_env() -> dict[str, str]:
    """The environment every podman command runs with here."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def docker_answers() -> bool:
    """Whether a docker daemon answers (a docker client alone is not enough)."""
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def require(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not found: {INSTALL_HINT}")


def debian_mirror() -> str:
    """The mirror apt uses for bookworm here, else Debian's own."""
    try:
        out = subprocess.run(
            ["apt-get", "indextargets", "--format", "$(REPO_URI)", "Codename: bookworm"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return FALLBACK_MIRROR
    return next((line.strip() for line in out.splitlines() if line.strip()), FALLBACK_MIRROR)


def image_exists(tag: str) -> bool:
    return subprocess.run(["podman", "image", "exists", tag], env=podman_env()).returncode == 0


def make_base(tag: str) -> None:
    """A bare Debian bookworm (minbase) as a podman image `tag`, without apt's caches (the build fetches lists)."""
    require("debootstrap")
    mirror = debian_mirror()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmserve-debian-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        print(f"making {tag}: debootstrap --variant=minbase bookworm from {mirror}", flush=True)
        subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / cache).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "-", tag], stdin=tar.stdout, check=True, env=podman_env())
        if tar.wait() != 0:
            raise SystemExit("tar of the Debian root failed")
    print(f"made {tag} in {time.monotonic() - start:.0f} s", flush=True)


@dataclass(slots=True)
class PipConfig:
    """This machine's pip configuration, for a build: one file that merges every setting `pip config list` shows
    (files and PIP_* variables), with each local path it names moved under HOST_PIP, and those paths to mount."""

    text: str
    mounts: list[Path]

    @classmethod
    def of(cls, pip: list[str], env: dict[str, str] | None = None) -> PipConfig:
        """The configuration that `pip` (a command line) runs with, in this environment or `env`."""
        out = subprocess.run([*pip, "config", "list"], capture_output=True, text=True, check=True, env=env).stdout
        sections: dict[str, dict[str, str]] = {}
        mounts: list[Path] = []
        # Files first, then the environment, which pip lets override them.
        lines = sorted(out.splitlines(), key=lambda line: line.startswith(":env:."))
        for line in lines:
            match = re.match(r"(.+)\.([^.=]+)='(.*)'$", line)
            if match is None:
                continue
            section, key, value = match.groups()
            section = "global" if section == ":env:" else section
            words = [cls._local(word, mounts) for word in value.split()]
            sections.setdefault(section, {})[key] = " ".join(words)
        text = "".join(
            f"[{name}]\n" + "".join(f"{key} = {value}\n" for key, value in values.items()) + "\n"
            for name, values in sections.items()
        )
        return cls(text, mounts)

    @staticmethod
    def _local(word: str, mounts: list[Path]) -> str:
        """`word` with a local path (or file:// URL) moved under HOST_PIP; the path to mount added to `mounts`."""
        url = word.startswith("file:///")
        if not (url or word.startswith("/")):
            return word
        path = Path(word.removeprefix("file://"))
        if not path.exists():
            return word
        # A local index's pages link to the files beside it (../../files/...): mount the folder above simple/.
        mount = path.parent if url and path.name == "simple" else path
        if mount not in mounts:
            mounts.append(mount)
        return ("file://" if url else "") + HOST_PIP + str(path)

    def volumes(self, folder: Path) -> list[str]:
        """podman's --volume options: the merged file (written into `folder`) and the paths it names, read-only."""
        (folder / "pip.conf").write_text(self.text)
        volumes = [f"--volume={folder / 'pip.conf'}:{HOST_PIP}/pip.conf:ro"]
        return volumes + [f"--volume={path}:{HOST_PIP}{path}:ro" for path in self.mounts]


def podman_build(image: str, base: str, torch_spec: str | None, pip: PipConfig, folder: Path) -> list[str]:
    """The podman build command of the CPU image on `base`, with `pip`'s configuration (written into `folder`)."""
    command = ["podman", "build", "--isolation", "chroot", "--network", "host", "--format", "docker"]
    command += pip.volumes(folder)
    command += ["--build-arg", f"PIP_CONFIG_FILE={HOST_PIP}/pip.conf"]
    command += ["--build-arg", "VARIANT=cpu", "--build-arg", f"PYTHON_IMAGE={base}"]
    command += ["--build-arg", f"TORCH_SPEC={torch_spec}"] if torch_spec else []
    return [*command, "--tag", image, str(ROOT)]


def docker_build(image: str, base: str | None) -> list[str]:
    """The docker build command of the CPU image (on the Dockerfile's base unless `base` is given)."""
    command = ["docker", "build", "--build-arg", "VARIANT=cpu"]
    command += ["--build-arg", f"PYTHON_IMAGE={base}"] if base else []
    return [*command, "--tag", image, str(ROOT)]


def image_size(engine: str, image: str) -> int:
    out = subprocess.run(
        [engine, "image", "inspect", "--format", "{{.Size}}", image],
        capture_output=True,
        text=True,
        check=True,
        env=podman_env(),
    ).stdout
    return int(out.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/image/build.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="llmserve:cpu", help="the tag to build (default: %(default)s)")
    parser.add_argument("--engine", choices=("docker", "podman"), help="default: docker where a daemon answers")
    parser.add_argument("--base", help=f"the base (PYTHON_IMAGE); default: the Dockerfile's, {LOCAL_BASE} with podman")
    parser.add_argument("--torch-spec", help="with podman: the torch to install (default: the Dockerfile's)")
    args = parser.parse_args(argv)
    engine = args.engine or ("docker" if docker_answers() else "podman")
    with tempfile.TemporaryDirectory(prefix="llmserve-image-") as tmp:
        if engine == "podman":
            require("podman", "runc")
            base = args.base or LOCAL_BASE
            if base == LOCAL_BASE and not image_exists(base):
                make_base(base)
            pip = PipConfig.of([sys.executable, "-m", "pip"])
            command = podman_build(args.image, base, args.torch_spec, pip, Path(tmp))
        else:
            command = docker_build(args.image, args.base)
        print("+", " ".join(command), flush=True)
        start = time.monotonic()
        subprocess.run(command, check=True, env=podman_env())
    seconds = time.monotonic() - start
    size = image_size(engine, args.image)
    print(f"built {args.image} with {engine} in {seconds:.0f} s: {size / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
