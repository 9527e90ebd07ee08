"""CPU linears through packed oneDNN weights compute what the plain layers compute: float32 as the model does,
bfloat16 and int8 within their rounding, each row the same whatever rows share its call."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.backends.cpu import native, packed_linear
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.models.loader import from_config
from tests.isa import dtype_param, needs_dtype
from tests.testing import TINY_VOCAB, tiny_config

# Decided without the function under test, so that a broken `available` fails here instead of skipping.
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
pytestmark = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN linear")


def test_available_exactly_for_float32_on_the_cpu() -> None:
    assert packed_linear.available(torch.device("cpu"), torch.float32)
    assert not packed_linear.available(torch.device("cpu"), torch.float64)
    assert not packed_linear.available(torch.device("cpu"), torch.bfloat16)
    assert not packed_linear.available(torch.device("meta"), torch.float32)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2's q/k/v projections have biases
def test_packed_model_gives_the_same_logits(family: str) -> None:
    loaded = from_config(tiny_config(family), dtype=torch.float32)
    model = loaded.model
    ids = torch.randint(TINY_VOCAB, (1, 57), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert packed_linear.pack_linears(model) == linears > 0
    assert packed_linear.pack_linears(model) == 0  # idempotent
    with torch.inference_mode():
        packed = model(input_ids=ids).logits
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    assert packed.argmax(-1).tolist() == plain.argmax(-1).tolist()


def test_engine_packs_float32_only_and_can_be_told_not_to() -> None:
    on, off = EngineConfig(kv_cache_tokens=256), EngineConfig(kv_cache_tokens=256, packed_linear=False)
    assert EngineCore(from_config(tiny_config(), dtype=torch.float32), on).backend.num_packed_linears > 0
    assert EngineCore(from_config(tiny_config(), dtype=torch.float32), off).backend.num_packed_linears == 0
    f64 = from_config(tiny_config(), dtype=torch.float64)
    assert EngineCore(f64, on).backend.num_packed_linears == 0
    assert packed_linear.pack_linears(f64.model) == 0


def quantized(x: torch.Tensor) -> native.Rows:
    ops = native.load_mixed()
    assert ops is not None
    return ops.convert(x, torch.uint8)


def rows_of(rows: native.Rows, start: int, end: int) -> native.Rows:
    if isinstance(rows, native.QuantizedRows):
        return native.QuantizedRows(rows.values[start:end].contiguous(), rows.scales[start:end].contiguous())
    return rows[start:end]


@pytest.mark.parametrize("kind", [dtype_param("bfloat16"), dtype_param("int8")])
@pytest.mark.parametrize("k", [576, 1536])  # SmolLM2's hidden size, and its MLP's (down's reduction, > 1,024)
def test_a_row_gives_the_same_alone_and_among_any_number_of_rows(kind: str, k: int) -> None:
    """Batch invariance of the bfloat16 and int8 linears: every row count from 1 to 70, and longer ones, at varied
    offsets, bit for bit against each row alone. Unsplit, oneDNN's bfloat16 kernel fails this at K = 1,536; on AMX,
    in one call, from 35 rows."""
    g = torch.Generator().manual_seed(k)
    weight, bias = torch.randn(96, k, generator=g) * 0.05, torch.randn(96, generator=g)
    linear = packed_linear.make_linear(weight, bias, kind, True, native.load_mixed(), torch.float32)
    x = torch.randn(600, k, generator=g).bfloat16()
    rows = x if kind == "bfloat16" else quantized(x.float())
    alone = torch.cat([linear(rows_of(rows, i, i + 1)) for i in range(600)])
    for m in [*range(1, 71), 129, 256, 333, 512, 600]:
        start = (m * 37) % (601 - m)
        assert torch.equal(linear(rows_of(rows, start, start + m)), alone[start : start + m]), m


@needs_dtype("bfloat16")
def test_bfloat16_rows_run_in_blocks_on_amx_only() -> None:
    """On AMX a bfloat16 call runs at most a block of rows (the kernel blocks more rows by their count), the largest
    the process's kernels keep invariant (32 where they are at every count); a longer input, in blocks, gives each
    row what that row gives alone, and what one call gives where that is invariant."""
    block = packed_linear.bf16_row_block("avx512_core_amx")
    assert block in packed_linear.AMX_ROW_BLOCKS
    if packed_linear.bf16_row_block() is None:  # no AMX here: oneDNN's kernel keeps every row count invariant
        assert block == packed_linear.AMX_ROW_BLOCKS[0] == 32
    assert packed_linear.bf16_row_block("avx512_core_bf16") is None
    assert packed_linear.bf16_row_block("avx2") is None
    g = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(96, 1536, generator=g) * 0.05, torch.randn(96, generator=g)
    blocked = packed_linear.PackedBF16.of(weight, bias, rows=8)
    x = torch.randn(70, 1536, generator=g).bfloat16()
    alone = torch.cat([blocked(x[i : i + 1]) for i in range(70)])
    for m in (8, 9, 17, 64, 70):
        assert torch.equal(blocked(x[:m]), alone[:m]), m
    if packed_linear.bf16_row_block() is None:
        assert torch.equal(packed_linear.PackedBF16.of(weight, bias)(x), alone)


@needs_dtype("bfloat16")
def test_the_row_block_falls_back_to_what_keeps_each_row_alike() -> None:
    """largest_invariant_block over a real kernel that is not invariant at every row count: oneDNN's bfloat16 linear
    over an unsplit reduction of 1,536 (the module docstring; without AMX it gives a row other results among as few
    as 2 rows, at some offsets). In calls of at most the block it finds, every row count gives each row what it
    gives alone."""
    g = torch.Generator().manual_seed(1536)
    weight, bias = torch.randn(96, 1536, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(64, 1536, generator=g).bfloat16()
    unsplit = packed_linear.PackedBF16([(0, packed_linear.pack_weight(weight.bfloat16()))], 1536, bias)
    block = packed_linear.largest_invariant_block([(unsplit, x)])
    if packed_linear.bf16_row_block() is None:
        assert block < 32
    blocked = packed_linear.PackedBF16(unsplit.parts, 1536, bias, rows=block)
    alone = torch.cat([unsplit(x[i : i + 1]) for i in range(64)])
    for m in range(1, 65):
        start = (m * 37) % (65 - m)
        assert torch.equal(blocked(x[start : start + m]), alone[start : start + m]), (block, m)


@pytest.mark.parametrize("kind", [dtype_param("bfloat16"), dtype_param("int8")])
def test_bfloat16_and_int8_linears_within_their_rounding(kind: str) -> None:
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(200, 1536, generator=g) * 0.05, torch.randn(200, generator=g)
    x = torch.randn(33, 1536, generator=g)
    expected = x @ weight.t() + bias
    linear = packed_linear.make_linear(weight, bias, kind, True, native.load_mixed(), torch.float32)
    assert linear.packed and linear.takes == (torch.bfloat16 if kind == "bfloat16" else torch.uint8)
    out = linear(x.bfloat16() if kind == "bfloat16" else quantized(x))
    error = (out.float() - expected).abs().mean() / expected.abs().mean()
    assert error < {"bfloat16": 0.01, "int8": 0.02}[kind], error


@pytest.mark.parametrize("kind", [dtype_param("bfloat16"), dtype_param("int8")])
def test_the_refined_head_picks_what_a_float32_head_picks(kind: str) -> None:
    """The cheap head's best candidates recomputed in float32: the argmax and those logits of a float32 head on
    the same (bfloat16) weights, each row alike alone or in a batch."""
    g = torch.Generator().manual_seed(6)
    weight = (torch.randn(4096, 576, generator=g) * 0.05).bfloat16()
    ops = native.load_mixed()
    assert ops is not None
    head = packed_linear.RefinedHead(
        packed_linear.make_linear(weight, None, kind, True, ops, torch.float32), weight, ops
    )
    exact = packed_linear.make_linear(weight.float(), None, "float32", True, ops, torch.float32)
    x = torch.randn(64, 576, generator=g)
    refined, expected = head(x), exact(x)
    assert torch.equal(refined.argmax(-1), expected.argmax(-1))
    top = expected.topk(3, dim=-1).indices
    torch.testing.assert_close(refined.gather(1, top), expected.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([head(x[i : i + 1]) for i in range(64)]), refined)
