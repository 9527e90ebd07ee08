"""The roofline's arithmetic, and the share of it a window's own work is held to."""

from __future__ import annotations

import pytest

from benchmarks import roofline
from benchmarks.analysis import floor_share, targets
from benchmarks.metrics import PointSummary, WindowStats
from tests.testing import tiny_config

PEAK = roofline.MachinePeak("cpu", "float32", matmul_flops_per_s=100e9, read_bytes_per_s=20e9, copy_bytes_per_s=20e9)
PROMPTS = [32, 100, 300, 1000]


def roof() -> roofline.Roofline:
    return roofline.roofline(tiny_config("llama", max_positions=2048), PEAK, 4, 32, PROMPTS, 128)


def window(prefills: list[tuple[int, int]], tokens: int, context: float, seconds: float = 10.0) -> WindowStats:
    return WindowStats(
        tokens / seconds / 128, tokens / seconds, None, None, None, None, None, None, 0, 0, 0,
        window_s=seconds, prefills=prefills, decode_context_mean=context,
    )  # fmt: skip


def test_model_work_counts_the_tiny_models_matmuls_by_hand() -> None:
    """tiny_config: hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 kv heads, vocabulary 512; 4-byte weights."""
    w = roof().work
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q and o, k and v, gate/up/down
    assert w.token_flops == 2 * 2 * per_layer == 147_456
    assert w.head_flops == 2 * 64 * 512 == 65_536
    assert w.attention_flops_per_pair == 4 * 4 * 16 * 2 == 512  # QK^T and PV, every head, both layers
    assert w.weight_bytes == 4 * (2 * per_layer + 64 * 512)
    assert w.kv_bytes_per_token == 2 * 2 * 16 * 2 * 4
    # 300 new tokens after 100 cached: 300 * 100 + 300 * 301 / 2 (query, key) pairs, one LM head.
    assert w.prefill_flops(300, cached=100) == 300 * 147_456 + (30_000 + 45_150) * 512 + 65_536
    flops, nbytes = w.decode_step(32, 400.0)
    assert flops == 32 * (147_456 + 65_536 + 400 * 512)
    assert nbytes == w.weight_bytes + 32 * 400 * 512


def test_the_floor_is_the_slower_of_compute_and_memory() -> None:
    r = roof()
    flops, nbytes = r.work.decode_step(32, 1000.0)
    # PEAK: 100 GFLOP/s and 20 GB/s; this tiny model's step is bound by reading its KV.
    assert nbytes / 20e9 > flops / 100e9
    assert r.decode_step_s(1000.0) == pytest.approx(nbytes / 20e9)
    one_prompt = r.work.prefill_flops(500) / 100e9
    assert r.work_floor_s([(500, 0)], 64, 1000.0) == pytest.approx(one_prompt + 64 * nbytes / 20e9 / 32)


def test_prefill_of_a_prompt_in_two_parts_costs_the_same_as_in_one() -> None:
    r = roof()
    w = r.work
    whole = w.prefill_flops(300)
    assert w.prefill_flops(100) + w.prefill_flops(200, cached=100) - w.head_flops == pytest.approx(whole)
    assert w.prefill_flops(300) > 300 * w.token_flops  # attention and the LM head on top of the layers


def test_work_floor_of_the_average_work_is_the_workload_floor() -> None:
    r = roof()
    assert r.decode_step_s(r.mean_context) == pytest.approx(r.step_floor_s)
    # Each prefill samples its request's first token; the other 127 take decode steps.
    seconds = r.work_floor_s([(n, 0) for n in PROMPTS], 127 * len(PROMPTS), r.mean_context)
    assert 128 * len(PROMPTS) / seconds == pytest.approx(r.max_output_tokens_per_s_with_prefill)


def test_a_window_that_served_longer_prompts_has_a_higher_floor() -> None:
    r = roof()
    light = window([(100, 0)] * 8, 1024, 200.0)
    heavy = window([(800, 0)] * 8, 1024, 900.0)  # the same tokens/s, more prompt work behind them
    assert floor_share(r, heavy) > floor_share(r, light) > 0
    # 1,024 tokens, 8 of them sampled by the prefills: 1,016 decoded.
    assert floor_share(r, light) == pytest.approx(r.work_floor_s([(100, 0)] * 8, 1016, 200.0) / 10.0)
    assert floor_share(r, window([], 0, None)) is None  # the window saw no tokens


def test_the_roofline_target_is_the_mean_share_of_the_windows() -> None:
    r = roof()
    windows = [window([(300, 0)] * 8, 1024, 400.0), window([(600, 0)] * 8, 1024, 700.0)]
    point = PointSummary("llmserve", 32, windows, {"output_tokens_per_s": 102.4}, {}, None, None)
    target = next(t for t in targets({"llmserve": {32: point}}, 32, r) if "roofline" in t.name)
    shares = [floor_share(r, w) for w in windows]
    assert target.value == pytest.approx(sum(shares) / 2)
    assert target.noise == pytest.approx((shares[1] - shares[0]) / target.value)
    assert target.met == (target.value >= 0.5)
