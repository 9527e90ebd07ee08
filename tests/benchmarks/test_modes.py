"""benchmarks/run.py's modes: every registered one parses its options, the feature modes run smoke-sized on a tiny
random model and write their page and JSON through the one writer, and a page is rebuilt from its JSON alone."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from benchmarks import run, writer
from benchmarks.modes import MODES
from llmserve import cpu_features


@pytest.mark.parametrize("name", sorted(MODES))
def test_every_mode_has_a_main_and_its_options_parse(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert callable(importlib.import_module(MODES[name].module).main)
    with pytest.raises(SystemExit) as exit_:
        run.main(["--mode", name, "--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_an_unknown_mode_is_refused_naming_the_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--mode", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown mode 'nope'" in err and "kv-tiers" in err


def smoke(mode: str, out: Path, *extra: str) -> tuple[dict, str]:
    assert (
        run.main(["--mode", mode, "--quick", "--model", "random:tiny", "--out-dir", str(out), "--name", mode, *extra])
        == 0
    )
    data = json.loads((out / f"{mode}.json").read_text())
    page = (out / f"{mode}.md").read_text()
    assert data["run"]["command"].startswith(f"python benchmarks/run.py --mode {mode} --quick")
    assert data["run"]["model"] == "random:tiny" and data["run"]["wall_s"] >= 0
    assert page.startswith("# ") and data["run"]["command"] in page
    return data, page


def test_kv_tiers_mode_reloads_returning_turns_from_disk(tmp_path: Path) -> None:
    data, page = smoke("kv-tiers", tmp_path, "--rounds", "1")
    disk = next(m for m in data["modes"] if m["mode"] == "disk tier")
    recompute = next(m for m in data["modes"] if m["mode"] == "recompute")
    assert disk["cached_share"] > 0.5 and disk["read_blocks"] > 0 and recompute["cached_share"] == 0
    assert data["restart"]["cached_after_restart"] > 0
    assert "| disk tier |" in page


def test_n_mode_computes_the_prompt_once_for_n_completions(tmp_path: Path) -> None:
    data, _ = smoke("n", tmp_path, "--prompt-tokens", "64")
    fanned, separate = data["median"]["n=4"], data["median"]["4 calls"]
    assert fanned["generated"] == separate["generated"] == 4 * 8
    assert fanned["prompt_tokens_computed"] < separate["prompt_tokens_computed"] <= 4 * 64


def test_append_mode_sends_fewer_bytes_for_the_same_outputs(tmp_path: Path) -> None:
    data, page = smoke("append", tmp_path)
    resend, append = data["append_mode"]["modes"]
    assert data["append_mode"]["same_outputs"]
    assert append["bytes_total"] < resend["bytes_total"]
    assert "outputs identical token for token: **yes**" in page


def test_a_page_is_built_from_its_json_alone(tmp_path: Path) -> None:
    def section(data: dict) -> list[str]:
        return writer.table(["a", "b"], [[data["x"], writer.seconds(data["t"])]])

    page = writer.publish(writer.Run("cmd --x"), tmp_path, "p", "Title", {"x": 1, "t": 0.25}, section)
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["x"] == 1 and data["run"]["command"] == "cmd --x"
    assert page.read_text() == "\n".join(writer.header("Title", data["run"]) + section(data)) + "\n"
    assert "| 1 | 250 ms |" in page.read_text()


def test_dtypes_mode_serves_each_dtype_over_grpc_and_skips_an_absent_llama_cpp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no llama-server on it
    data, page = smoke("dtypes", tmp_path, "--dtypes", "int8")
    assert set(data["peaks"]) == {"float32", "bfloat16", "int8"}
    assert "llama.cpp skipped: no llama-server" in page
    refused = cpu_features.refusal("int8", cpu_features.cpu_level())
    if refused is not None:  # below AVX512-VNNI the server would refuse to start: the page says so, nothing runs
        assert f"llmserve int8 skipped: {refused}" in page and not data["points"]
        return
    point = data["points"]["llmserve int8"]["1"]
    assert point["median_output_tokens_per_s"] > 0 and point["errors"] == 0 and point["peak_memory_bytes"] > 0
    assert "--dtype int8" in " ".join(data["systems"]["llmserve int8"]["command"])
    assert "| llmserve int8 | 1 |" in page


def test_gguf_mode_serves_the_default_file_from_its_blocks_and_skips_an_absent_llama_cpp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    args = ["--mode", "gguf", "--quick", "--files", "default", "--out-dir", str(tmp_path), "--name", "gguf"]
    assert run.main(args) == 0
    data = json.loads((tmp_path / "gguf.json").read_text())
    page = (tmp_path / "gguf.md").read_text()
    f = data["files"]["default"]
    point = f["points"]["llmserve"]["1"]
    (window,) = point["rounds"]
    assert window["output_tokens_per_s"] > 0 and point["errors"] == 0 and point["peak_memory_bytes"] > 0
    assert window["decode_per_stream"] > 0 and window["decode_samples"] > 0
    # The one round counts where it was steady (a loaded machine may hold the first call past the short warm-up).
    assert f["steady"]["1"] == [window["counted"]]
    if window["counted"]:  # a round's figure is kept to 2 decimals, the median over rounds is not
        assert round(point["median_decode_per_stream"], 2) == window["decode_per_stream"]
    else:
        assert point["median_output_tokens_per_s"] is None and "(not steady:" in page
    assert "--dtype auto" in " ".join(f["commands"]["llmserve"]["1"]) and f["start_s"]["llmserve"]["1"] > 0
    assert f["kind"] == "Q4_1" and f["kv_pool_bytes"] > 0 and data["workload"]["name"] == "chat"
    assert "default: llama.cpp skipped" in page and "| default | llmserve | 1 |" in page
    assert "peak memory vs file + KV pool + 1 GiB" in page and "decode per stream" in page
    # Perplexity needs llama.cpp's tools: without them the page says so.
    assert run.main(["--mode", "gguf", "--perplexity", "--out-dir", str(tmp_path), "--name", "ppl"]) == 0
    assert "skipped: no llama-perplexity" in (tmp_path / "ppl.md").read_text()


def test_gguf_modes_decode_workload_is_short_prompts_and_256_new_tokens_at_1_and_4_clients() -> None:
    from benchmarks.modes import gguf_blocks

    args = gguf_blocks.parse_args(["--workload", "decode", "--files", "default,1b-q8"])
    assert args.client_counts == [1, 4] and (args.warmup_s, args.window_s) == (30.0, 30.0)
    for spec in args.file_specs:  # every file's calls the same size, whatever its chat workload's
        w = gguf_blocks.workload_spec(spec, args)
        assert (w.min_prompt, w.max_prompt, w.max_new_tokens) == (40, 64, 256)
    chat = gguf_blocks.parse_args(["--files", "1b-q8", "--clients", "1,32", "--new-tokens", "16"])
    assert chat.client_counts == [1, 32] and gguf_blocks.workload_spec(chat.file_specs[0], chat).max_new_tokens == 16
    plain = gguf_blocks.parse_args(["--files", "1b-q8"])
    assert gguf_blocks.workload_spec(plain.file_specs[0], plain).max_new_tokens == 64  # the file's own
    # A GGUF file by its path (a Q8_0 of the default model, say), its type read from the file.
    from llmserve.models.gguf import default_gguf_path

    (given,) = gguf_blocks.parse_args(["--files", str(default_gguf_path())]).file_specs
    assert (given.kind, given.path, given.clients) == ("Q4_1", default_gguf_path(), (1, 4, 32))
    with pytest.raises(SystemExit):
        gguf_blocks.parse_args(["--files", "nope"])


def gguf_figures(rounds: dict[str, list[tuple[float, float | None, int, int]]], steady: list[bool]) -> dict:
    """A gguf run's JSON at one client with the given rounds per system: (tok/s, decode, warm clients, calls)."""

    def point(rs: list[tuple[float, float | None, int, int]]) -> dict:
        kept = [r for r, keep in zip(rs, steady, strict=True) if keep]
        return {
            "median_output_tokens_per_s": kept[0][0] if kept else None,
            "median_decode_per_stream": kept[0][1] if kept else None,
            "decode_samples": 7 * len(kept),
            "ttft_p50_s": 0.08,
            "ttft_p99_s": 0.1,
            "peak_memory_bytes": 1 << 30,
            "errors": 0,
            "rounds": [
                {"output_tokens_per_s": t, "decode_per_stream": d, "warm_clients": w, "completed": n, "counted": keep}
                for (t, d, w, n), keep in zip(rs, steady, strict=True)
            ],
        }

    return {
        "cpu": 2,
        "cpu_isa_cap": "avx2",
        "workload": {"name": "decode", "summary": "short prompts, 256 new tokens"},
        "rounds": len(steady),
        "window_s": 30.0,
        "warmup_s": 30.0,
        "steady_min_calls": 3,
        "notes": [],
        "files": {
            "default": {
                "file": "/f.gguf",
                "file_bytes": 1 << 27,
                "kind": "Q4_1",
                "shape": "SmolLM2",
                "kv_pool_bytes": 1 << 30,
                "metadata_cache_s": 0.0,
                "workload": {"min_prompt": 40, "max_prompt": 64, "new_tokens": 256},
                "start_s": {"llmserve": {"1": 5.0}, "llama.cpp": {"1": 1.0}},
                "commands": {"llmserve": {"1": ["python", "-m", "llmserve"]}, "llama.cpp": {"1": ["ls", "-np", "1"]}},
                "steady": {"1": steady},
                "points": {name: {"1": point(rs)} for name, rs in rounds.items()},
            }
        },
    }


def test_the_gguf_page_labels_targets_on_steady_rounds_only() -> None:
    from benchmarks.modes.gguf_blocks import section

    rounds = {
        "llmserve": [(70.0, 68.0, 1, 8), (300.0, 290.0, 1, 9)],
        "llama.cpp": [(40.0, 100.0, 1, 5), (7.0, None, 0, 1)],
    }
    page = "\n".join(section(gguf_figures(rounds, [True, False])))
    assert "| default | 1 | 1 of 2 | 1.75× (target met) | 0.68× (target 1× missed) |" in page
    assert "300.0 / 290.0 (not steady: another system was not)" in page
    assert "7.0 / – (not steady: 0 of 1 clients had finished a call before it, 1 calls finished in it)" in page
    assert "llama.cpp, 1 client(s): `ls -np 1`" in page and "LLMSERVE_CPU_ISA=avx2" in page
    # No steady round: figures listed, no ratio and no target label.
    page = "\n".join(section(gguf_figures(rounds, [False, False])))
    assert (
        "| default | 1 | 0 of 2 | not steady | not steady |" in page
        and "target" not in page.split("| file | clients")[1]
    )


def test_host_overhead_times_the_engine_process_through_the_front_end(tmp_path: Path) -> None:
    """The probe the engine-process figures came from: the core in its child process, every request streamed
    through the front end, the child's pass times read back (it broke once unnoticed when the front end came to
    hold the model's card instead of the model)."""
    out = tmp_path / "times.json"
    argv = ["--mode", "host-overhead", "--front-end", "--engine-process", "--backends", "cpu", "--batches", "4"]
    assert run.main([*argv, "--steps", "10", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["cpu/4"]
    assert 0 < figures["median_ms"] <= figures["p90_ms"]


def test_embed_mode_measures_the_library_both_call_shapes_and_llama_server_or_says_why_not(tmp_path: Path) -> None:
    """llama-server beside where this machine has it ($LLAMA_SERVER, $LLAMA_CPP_BIN, PATH; its GGUF cached or a
    converter found), else the page's reason."""
    from benchmarks.systems import llama_embed
    from llmserve.models import packaged

    folder = packaged.resolve("all-minilm-l6-v2", None)
    peer = folder is not None and llama_embed.available(folder)
    args = ["--mode", "embed", "--quick", "--parts", "encode", "--out-dir", str(tmp_path), "--name", "embed"]
    assert run.main(args) == 0
    data = json.loads((tmp_path / "embed.json").read_text())
    page = (tmp_path / "embed.md").read_text()
    systems = ("sentence-transformers", "llmserve 1/call", "llmserve 32/call")
    for system in systems + (("llama-server 1/call", "llama-server 32/call") if peer else ()):
        (window,) = data["encode"]["runs"][system]
        assert window["embeddings_per_s"] > 0 and window["calls"] > 0 and window["peak_rss_bytes"] > 0
    if peer:
        assert data["encode"]["peer"]["max_difference"] < llama_embed.TOLERANCE
        assert set(data["encode"]["ratio_to_peer"]) == {"1/call", "32/call"} and "llmserve / llama-server" in page
    else:
        assert "llama-server skipped: no " in page and "peer" not in data["encode"]
    assert data["run"]["model"] == "all-minilm-l6-v2" and "| llmserve 32/call |" in page
    matmul = data["encode"]["fp32_matmul"]
    assert matmul in ("ieee", "bf16x3") and f"(--fp32-matmul auto): {matmul} on this machine" in page
    assert "mixed" not in data


def test_embed_page_gives_llmserve_over_llama_server_at_each_call_shape() -> None:
    from benchmarks.modes import embed

    def run_(rate: float) -> dict:
        return {"embeddings_per_s": rate, "p50_s": 0.1, "p99_s": 0.2, "peak_rss_bytes": 2**20}

    rates = {"sentence-transformers": 100.0, "llmserve 1/call": 300.0, "llmserve 32/call": 390.0}
    rates |= {"llama-server 1/call": 250.0, "llama-server 32/call": 260.0}
    runs = {system: [run_(rate) | {"calls": 1}] for system, rate in rates.items()}
    medians = {system: run_(rate) for system, rate in rates.items()}
    encode = {"sentences": 10, "windows": 1, "warmup_s": 1.0, "window_s": 2.0, "clients": 32, "batch_clients": 4}
    encode |= {"st_chunk": 512, "runs": runs, "median": medians, "ratio_to_library": {s: 1.0 for s in rates}}
    encode |= {"peer": {"command": ["llama-server", "-np", "128"], "max_difference": 3e-4, "checked_texts": 16}}
    encode["ratio_to_peer"] = embed.ratio_to_peer(medians)
    assert encode["ratio_to_peer"] == {"1/call": 1.2, "32/call": 1.5}
    page = "\n".join(embed.section({"encode": encode}))
    assert "**1.20×** at one text per call (target >= 1.0x), **1.50×** at 32" in page
    assert "at most 3.0e-04 on 16 sentences" in page and "`llama-server -np 128`" in page
    assert "| llama-server 32/call | 260.0 |" in page
    skipped = {key: value for key, value in encode.items() if key not in ("peer", "ratio_to_peer")}
    assert "llama-server skipped: --no-peer." in "\n".join(
        embed.section({"encode": skipped | {"peer_skipped": "--no-peer"}})
    )


def test_embed_mode_measures_generation_with_and_without_embeddings_beside_it(tmp_path: Path) -> None:
    args = ["--mode", "embed", "--quick", "--parts", "mixed", "--gen-model", "random:tiny"]
    assert run.main([*args, "--out-dir", str(tmp_path), "--name", "mixed"]) == 0
    mixed = json.loads((tmp_path / "mixed.json").read_text())["mixed"]
    (alone,) = mixed["runs"]["generation alone"]
    (beside,) = mixed["runs"]["generation + embeddings"]
    assert alone["gen_tokens_per_s"] > 0 and beside["gen_tokens_per_s"] > 0 and mixed["gen_ratio"] > 0
    assert alone["embed_calls"] == 0 and beside["embed_calls"] > 0 and beside["embeddings_per_s"] > 0
    assert beside["peak_rss_bytes"] > 0
    assert "| generation + embeddings |" in (tmp_path / "mixed.md").read_text()
