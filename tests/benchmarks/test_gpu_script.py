"""benchmarks/probes/gpu.sh, the GPU run prepared for a lent H200, kept from rotting on machines without one: its
dry run (every part on the CPU at tiny sizes in one process, the varlen kernel through Triton's interpreter) exits
0 and writes every figure the GPU run is to fill in, with the argument wiring of each part: the check's Embed call
matches sentence-transformers and its GGUF is served from the float folder it converts into, as on the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "gpu.sh"


def test_the_gpu_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_gpu_script_runs_dry_on_the_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for part in ("check", "perf", "ladder"):
        assert f"== {part}: exit 0" in proc.stdout
    check = json.loads((tmp_path / "gpu_check.json").read_text())
    assert check["exactness_fp64"]["equal"] == check["exactness_fp64"]["requests"] > 0
    assert "tokens_agreeing_before_first_difference" in check["agreement_bf16"]
    embed = check["embed"]
    assert embed["model"].startswith("random weights") and embed["inputs"] == 4, embed  # the device's stand-in
    assert embed.get("close") and embed["max_cosine_between_inputs"] < 0.99, embed
    gguf = check["gguf_dequantized"]
    assert gguf["file"].endswith(".Q4_1.gguf") and gguf["dequantized"] and gguf["dtype"] == "float32", gguf
    assert len(gguf["tokens_agreeing_before_first_difference"]) == gguf["requests"] > 0, gguf
    summary = json.loads((tmp_path / "gpu-perf-smoke.json").read_text())
    shape = summary["smollm2-135m"]
    assert "errors" not in shape, shape["errors"]
    start = shape["start"]
    assert start["graphs"] > 0 and start["captured"] == 0  # the CPU prepares each bucket eagerly
    assert start["graph_reserve_s"] >= 0 and start["capture_s"] >= 0
    nano = shape["nanovllm"]
    for system in ("llmserve", "llmserve_grpc", "llmserve_grpc_engine_in_process"):
        assert nano[system]["tok_s"] > 0 and nano[system]["capped"] is False, system
    assert set(shape["decode_step_ms"]) == set(shape["gpu_idle_share"]) == {"1", "4"}
    assert set(shape["mixed_step_ms"]) == {"eager"}  # the compile modes: test_piecewise.py
    assert all(m["steps"] >= 2 and m["ms"] > 0 for m in shape["mixed_step_ms"].values())
    ladder = json.loads((tmp_path / "gpu-ladder-dry.json").read_text())
    assert {"hf_continuous", "llmserve"} <= set(ladder["points"])
