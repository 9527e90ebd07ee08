"""The engine core's stats snapshot (EngineStats) for the metrics, read from its books without a lock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.engine.frontend.protocol import EngineStats

if TYPE_CHECKING:
    from llmserve.engine.core.engine_core import EngineCore


def core_stats(core: EngineCore) -> EngineStats:
    """Plain ints, each read atomically: a scrape never stalls a step. `waiting`: what the core holds and does not
    run (its clients count what is on the way to it too: core_client.InFlight)."""
    pool, sessions, scheduler = core.pool, core.sessions, core.scheduler
    free = pool.num_free
    return EngineStats(
        running=core.num_running,
        waiting=scheduler.num_waiting + len(core.compiling),
        kv_blocks_total=pool.num_blocks,
        kv_blocks_used=pool.num_blocks - free,
        kv_blocks_cached=pool.num_cached,
        block_size=pool.block_size,
        sessions=len(sessions),
        session_blocks=sessions.num_blocks_held,
        preemptions=scheduler.num_preemptions,
        session_hits=scheduler.num_session_hits,
        session_misses=scheduler.num_session_misses,
        session_evictions=dict(sessions.evictions),
        prefix_cache_hits=scheduler.num_prefix_cache_hits,
        kv_tiers=core.tiers.stats() if core.tiers is not None else None,
        lora=None if core.lora is None else core.lora.stats_of(scheduler),
        speculation=core.drafter.snapshot() if core.drafter is not None else None,
    )
