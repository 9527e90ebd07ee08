"""What the Makefile's targets give the processes they start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_keeps_bytecode_where_the_machine_says_not_to(tmp_path: Path) -> None:
    """On a machine that sets PYTHONDONTWRITEBYTECODE (this project's CI machines do), a process that make starts
    still writes and reads bytecode, under .cache/pycache (without it, every test's server compiled torch's and
    transformers' modules from source at each start: 62% of a server's start); a prefix of the caller's own stays."""
    probe = tmp_path / "probe.mk"
    show = "import sys; print(sys.flags.dont_write_bytecode, sys.pycache_prefix)"
    probe.write_text(f'include Makefile\nprobe-bytecode:\n\t@{sys.executable} -c "{show}"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "MAKEFLAGS", "MAKELEVEL")}

    def run(**extra: str) -> str:
        command = ["make", "-s", "--no-print-directory", "-C", str(ROOT), "-f", str(probe), "probe-bytecode"]
        out = subprocess.run(
            command,
            env={**env, "PYTHONDONTWRITEBYTECODE": "1", **extra},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout.strip()

    assert run() == f"0 {ROOT}/.cache/pycache"
    assert run(PYTHONPYCACHEPREFIX=str(tmp_path / "mine")) == f"0 {tmp_path / 'mine'}"
