"""Process-wide settings come from one call made by the process owner, and an operator's own values win."""

from __future__ import annotations

from llmserve.process_settings import configure_process


def test_defaults_and_what_an_operator_set_wins() -> None:
    env: dict[str, str] = {}
    configure_process(env)
    assert env == {"HF_HUB_OFFLINE": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}
    shared: dict[str, str] = {}
    configure_process(shared, shared_cores=True)  # the test session: a short spin
    assert shared["GOMP_SPINCOUNT"] == "3000"
    mine = {"OMP_WAIT_POLICY": "PASSIVE", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    configure_process(mine, shared_cores=True)
    assert "GOMP_SPINCOUNT" not in mine and mine["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_importing_llmserve_changes_nothing() -> None:
    """What llmserve's modules do on import, apart from what torch and transformers do on theirs."""
    import subprocess
    import sys

    # torch sets TORCHINDUCTOR_CACHE_DIR when some of its own submodules load: its doing, not ours.
    code = (
        "import os, torch, transformers, grpc; mine = lambda: {k: v for k, v in os.environ.items() "
        "if not k.startswith('TORCH')}; before = mine(); "
        "import llmserve.engine.core.engine_core, llmserve.engine.backends.cpu.backend, llmserve.app, "
        "llmserve.api.servicer; "
        "print(before == mine())"
    )
    import os

    # Nothing of this process's environment but PATH, and where it finds llmserve (a checkout's server/ folder).
    env = {"PATH": "/usr/bin", **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_the_served_process_makes_its_settings_before_torch_loads() -> None:
    """`python -m llmserve` calls configure_process() before anything imports torch: the config, the parser and
    --help load no tensor library (they did, through history -> engine.request, so libgomp had read its
    settings before they were made)."""
    import subprocess
    import sys

    code = (
        "import sys; import llmserve.__main__, llmserve.config as c; c.build_parser({}); "
        "c.from_args(['--address', '127.0.0.1:0'], env={}); "
        "loaded = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules); print(loaded)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
    helped = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "llmserve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and "--address" in helped.stdout, helped.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in helped.stderr.splitlines() if line.startswith("import")}
    assert "llmserve.config" in imported and not imported & {"torch", "transformers"}
