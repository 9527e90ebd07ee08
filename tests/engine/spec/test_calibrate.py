"""The start-up measurement of the load rule's step-cost table (spec/calibrate.py), on a real core: the table's shape
follows the core's limits, its cells are real step times, and the throwaway requests it decodes leave nothing behind
(no live sequence, no block held, no output, nothing counted in the speculation metrics)."""

from __future__ import annotations

import pytest

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.spec.calibrate import BATCHES, KS
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from tests.testing import tiny_model


@pytest.fixture
def core() -> EngineCore:  # one per test: each test sees a core just calibrated, whatever the order
    # 8 sequences at most: batches 1 and 4 of BATCHES; 64 tokens a step: at 4 sequences k = 16 does not fit.
    config = EngineConfig(speculative="ngram", max_num_seqs=8, max_num_batched_tokens=64, kv_cache_tokens=4096)
    engine = EngineCore(tiny_model(), config)
    engine.warm_up()  # measures the table: none was given
    return engine


def test_the_table_follows_the_cores_limits(core: EngineCore) -> None:
    assert core.speculation is not None
    drafter = core.speculation.drafter
    assert drafter.cost is not None and drafter.policy is not None
    table = drafter.cost
    assert table.batches == tuple(b for b in BATCHES if b <= 8) == (1, 4)
    assert table.ks == KS
    assert all(ms > 0 for row in table.ms for ms in row)
    # At 4 sequences k = 16 (68 tokens) is past the 64-token budget: read off the line through k = 4 and 8.
    row = dict(zip(table.ks, table.ms[1], strict=True))
    assert row[16] == pytest.approx(row[8] + (row[8] - row[4]) / 4 * 8)


def test_the_calibration_leaves_nothing_behind(core: EngineCore) -> None:
    assert core.speculation is not None
    assert not core.scheduler.live and not core.scheduler.running and not core.scheduler.has_work
    assert core.pool.num_free == core.pool.num_blocks  # every block of the throwaway requests freed
    assert core.speculation.drafter.forced_k is None
    stats = core.speculation.drafter.stats
    assert (stats.steps, stats.proposed, stats.verifying, stats.off_steps) == (0, 0, 0, 0)
    assert core.take_outputs() == []


def test_a_calibrated_core_serves_and_asks_the_rule(core: EngineCore) -> None:
    """After the measurement the core serves a request to its end, asking the load rule each step."""
    request = GenerationRequest("after", (5, 6, 7, 5, 6, 7, 5, 6), stopping=StoppingParams(max_new_tokens=12))
    core.submit(request, handle=1)
    tokens: list[int] = []
    done = False
    while not done:
        core.drain_inbox()
        core.step()
        for out in core.take_outputs():
            tokens += out.token_ids
            done = done or out.finished
    assert 1 <= len(tokens) <= 12
    assert core.speculation is not None
    stats = core.speculation.drafter.stats
    assert stats.steps + stats.off_steps > 0  # every decoding step was put to the rule
    assert core.pool.num_free == core.pool.num_blocks
