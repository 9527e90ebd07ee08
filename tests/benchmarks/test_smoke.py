"""The whole benchmark pipeline on a tiny random model: every system, roofline, report, plots, sessions.

Proves the benchmark code works; the figures mean nothing. The model is saved to a folder so that the gRPC
server subprocess can load the same one by path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import run
from llmserve.models.loader import from_config
from tests.testing import tiny_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config("llama", max_positions=512)
    folder = tmp_path_factory.mktemp("tiny-llama")
    from_config(config, None, seed=0).model.save_pretrained(folder)
    return folder


def bench(model: Path, out: Path, *extra: str) -> dict:
    argv = ["--plan", "tiny", "--model", str(model), "--device", "cpu", "--out-dir", str(out), "--name", "smoke"]
    assert run.main([*argv, *extra]) == 0
    for suffix in (".md", ".json", "-throughput.png", "-ttft-p99.png"):
        assert (out / f"smoke{suffix}").stat().st_size > 0
    return json.loads((out / "smoke.json").read_text())


def test_in_process_systems(tiny_model: Path, tmp_path: Path) -> None:
    systems = "naive,dynamic,hf_continuous,llmserve"
    result = bench(tiny_model, tmp_path, "--systems", systems, "--isolation", "inline")
    main = str(result["settings"]["plan"]["main"]["concurrency"])
    for system in systems.split(","):
        point = result["points"][system][main]
        assert point["mean"]["output_tokens_per_s"] > 0, system
        assert len(point["windows"]) == 2
    # Single workers are composed above their batch size; the others are measured at every point.
    assert result["points"]["naive"][main]["composed_from_concurrency"] == 1
    assert result["points"]["llmserve"][main]["composed_from_concurrency"] is None
    assert result["roofline"]["max_decode_tokens_per_s"] > 0
    roof = next(t for t in result["targets"] if "roofline" in t["name"])
    assert roof["value"] > 0  # from the windows' own work: every window records its prompts and contexts
    assert all(w["prefills"] and w["decode_context_mean"] for w in result["points"]["llmserve"][main]["windows"])
    assert "### Output tokens/s by concurrency" in (tmp_path / "smoke.md").read_text()


def test_grpc_and_sessions_in_their_own_processes(tiny_model: Path, tmp_path: Path) -> None:
    result = bench(tiny_model, tmp_path, "--systems", "llmserve_grpc,llmserve_grpc_metrics", "--sessions")
    main = str(result["settings"]["plan"]["main"]["concurrency"])
    assert result["points"]["llmserve_grpc"][main]["mean"]["output_tokens_per_s"] > 0
    assert result["points"]["llmserve_grpc_metrics"][main]["mean"]["output_tokens_per_s"] > 0
    cost = next(t for t in result["targets"] if "metrics on / off" in t["name"])
    assert cost["value"] > 0
    sessions = result["sessions"]
    assert sessions is not None
    on, off = sessions["multi_turn"]
    assert on["reuse"] and on["hit_rate"] > 0.3
    assert not off["reuse"] and off["cached_prompt_tokens"] == 0
    assert all(c > 0 for c in sessions["long_history"]["cached_prompt_tokens"])
    append = sessions["append_mode"]
    resend_mode, append_mode = append["modes"]
    assert append["same_outputs"] and append_mode["mode"] == "append"
    # Append mode sends the first turn whole, then only the new tokens: less than the resend from turn 2 on.
    assert append_mode["bytes_per_turn"][0] == resend_mode["bytes_per_turn"][0]
    later = zip(append_mode["bytes_per_turn"][1:], resend_mode["bytes_per_turn"][1:], strict=True)
    assert all(a < r for a, r in later)
