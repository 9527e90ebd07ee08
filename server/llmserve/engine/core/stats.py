"""The engine core's stats snapshot (EngineStats) for the metrics, read from its books without a lock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.engine.core.compiling import Compiling
from llmserve.engine.sched.block_pool import BlockPool
from llmserve.engine.sched.scheduler import Scheduler
from llmserve.engine.sched.sessions import SessionStore
from llmserve.engine.types.protocol import EngineStats

if TYPE_CHECKING:
    from llmserve.engine.kv_tiers.worker import KVTiers
    from llmserve.engine.lora.serving import LoraServing
    from llmserve.engine.spec.speculation import Speculation


class CoreStats:
    """The books a core's stats are read from (the core's own: they never change once it is built)."""

    __slots__ = ("pool", "sessions", "scheduler", "compiling", "tiers", "lora")

    def __init__(
        self,
        pool: BlockPool,
        sessions: SessionStore,
        scheduler: Scheduler,
        compiling: Compiling,
        tiers: KVTiers | None,
        lora: LoraServing | None,
    ) -> None:
        self.pool = pool
        self.sessions = sessions
        self.scheduler = scheduler
        self.compiling = compiling
        self.tiers = tiers
        self.lora = lora

    def snapshot(self, speculation: Speculation | None) -> EngineStats:
        """Plain ints, each read atomically: a scrape never stalls a step. `waiting`: what the core holds and does
        not run (its clients count what is on the way to it too: client.ClientRequests). `speculation`: the core's
        now (it turns off when measuring its cost fails)."""
        pool, sessions, scheduler = self.pool, self.sessions, self.scheduler
        free = pool.num_free
        return EngineStats(
            running=len(scheduler.running),
            waiting=scheduler.num_waiting + len(self.compiling),
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
            kv_tiers=self.tiers.stats() if self.tiers is not None else None,
            lora=None if self.lora is None else self.lora.stats_of(scheduler),
            speculation=speculation.stats() if speculation is not None else None,
        )
