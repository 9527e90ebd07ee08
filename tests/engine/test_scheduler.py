"""Property-based tests of the block pool, session store and scheduler together (no model, no tensors).

A state machine adds, steps, fails steps, aborts, finishes, preempts and deletes sessions in any order. It
keeps a shadow of the KV cache (which token each slot holds, as the runner would have written it), so after
every rule it can check what the engine relies on: every token a running sequence or a session counts as
computed is in its slot, whatever blocks were shared, copied, cached or reused. Also after every rule: the
pool's books match the owners exactly, writable blocks are exclusively owned, the running count, the session
count and the sessions' pool share stay within their limits; each step admits in priority order; and at the
end everything comes back free.
"""

from __future__ import annotations

from collections import defaultdict

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmserve.engine.block_pool import BlockPool
from llmserve.engine.plan import StepPlan
from llmserve.engine.request import FinishReason, GenerationRequest, SeqStatus, Sequence, StoppingParams
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sessions import SessionStore

BLOCK_SIZE = 4
MAX_SESSIONS = 3
SESSION_POOL_FRACTION = 0.5
GARBAGE = -1  # what a failed forward may leave in the slots it was writing


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class EngineBooks(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(min_value=12, max_value=40),
        max_seqs=st.integers(min_value=1, max_value=5),
        budget=st.integers(min_value=8, max_value=24),
        prefix=st.booleans(),
    )
    def setup(self, num_blocks: int, max_seqs: int, budget: int, prefix: bool) -> None:
        self.clock = Clock()
        self.pool = BlockPool(num_blocks, BLOCK_SIZE)
        self.sessions = SessionStore(
            self.pool,
            ttl_s=10.0,
            max_sessions=MAX_SESSIONS,
            max_pool_fraction=SESSION_POOL_FRACTION,
            clock=self.clock,
        )
        self.scheduler = Scheduler(
            self.pool, self.sessions, max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_prefix_caching=prefix
        )
        self.live: list[Sequence] = []
        self.n = 0
        # block -> the token in each slot (None: never written since the pool began)
        self.kv: defaultdict[int, list[int | None]] = defaultdict(lambda: [None] * BLOCK_SIZE)

    # Prompts from a tiny alphabet with shared heads, so prefix and session reuse really happen.
    @rule(
        head=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [7] * 13, []]),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=14),
        max_new=st.integers(1, 6),
        session=st.sampled_from([None, "a", "b", "c", "d"]),
        priority=st.sampled_from([0, 0, 0, 1, 5, -2]),
    )
    def add(self, head: list[int], tail: list[int], max_new: int, session: str | None, priority: int) -> None:
        self.add_prompt(head + tail, max_new, session, priority)

    def add_prompt(self, prompt: list[int], max_new: int, session: str | None, priority: int = 0) -> None:
        if len(self.live) >= 8:
            return
        if self.pool.blocks_for(len(prompt) + max_new) > self.pool.num_blocks:
            return  # the engine rejects these before they reach the scheduler
        self.n += 1
        request = GenerationRequest(
            f"r{self.n}",
            tuple(prompt),
            stopping=StoppingParams(max_new_tokens=max_new),
            session_id=session,
            priority=priority,
        )
        seq = Sequence(request, list(prompt), float(self.n), self.n)
        self.scheduler.add(seq)
        self.live.append(seq)

    @precondition(lambda self: len(self.sessions) > 0)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def follow_up(self, data: st.DataObject, extra: list[int]) -> None:
        """The next turn of a conversation: the session's tokens (maybe cut short, as if edited) plus more."""
        session_id = data.draw(st.sampled_from([s for s in "abcd" if s in self.sessions]))
        cached = self.sessions.get(session_id).token_ids
        cut = data.draw(st.integers(0, len(cached)))
        self.add_prompt(cached[:cut] + extra, 3, session_id)

    def schedule(self) -> StepPlan:
        """One schedule() call, checked for admission order and the running-count limit."""
        waiting = [seq for seq in self.live if seq.status is SeqStatus.WAITING]
        out = self.scheduler.schedule()
        admitted = [seq for seq in waiting if seq.status is SeqStatus.RUNNING]
        left = [seq for seq in waiting if seq.status is SeqStatus.WAITING]

        def order(seq: Sequence) -> tuple[int, int]:
            return (-seq.request.priority, seq.seq_no)

        # Higher priority first, then age; a preempted sequence keeps its age.
        if admitted and left:
            assert max(map(order, admitted)) < min(map(order, left))
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        return out

    def write(self, seq: Sequence, n: int, garbage: bool = False) -> None:
        """What the forward writes: the KV of the sequence's next n tokens, into its own slots."""
        for p in range(seq.num_computed, seq.num_computed + n):
            self.kv[seq.block_table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = GARBAGE if garbage else seq.token_ids[p]

    @rule(token=st.integers(0, 3))
    def step(self, token: int) -> None:
        out = self.schedule()
        for src, dst in out.copies:
            self.kv[dst] = list(self.kv[src])
        for src, dst in out.copies:
            assert self.pool.ref_count[src] >= 1 and self.pool.ref_count[dst] == 1
        for entry in out.seqs:
            seq, n = entry.seq, entry.num_tokens
            assert n >= 1 and seq.status is SeqStatus.RUNNING
            assert entry.start == seq.num_computed and list(entry.token_ids) == seq.token_ids[entry.start : entry.end]
            # It samples exactly when the step reaches its last token.
            assert (entry.sample is not None) == (entry.end == len(seq.token_ids))
            assert len(seq.block_table) >= self.pool.blocks_for(seq.num_computed + n)
            # The blocks this step writes into belong to this sequence alone (copy on write).
            for block in seq.block_table[seq.num_computed // BLOCK_SIZE : self.pool.blocks_for(seq.num_computed + n)]:
                assert self.pool.ref_count[block] == 1
        assert out.num_tokens <= self.scheduler.max_num_batched_tokens
        for entry in out.seqs:
            self.write(entry.seq, entry.num_tokens)
        ready = self.scheduler.update(out)
        for seq in ready:
            seq.token_ids.append(token)
            if seq.num_generated >= seq.request.stopping.max_new_tokens:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                self.live.remove(seq)

    @rule(copied=st.booleans())
    def fail_step(self, copied: bool) -> None:
        """The shared forward raises: the copies may or may not have happened, the slots it was writing hold
        garbage, and every request of the step ends with an error."""
        out = self.schedule()
        if copied:
            for src, dst in out.copies:
                self.kv[dst] = list(self.kv[src])
        for entry in out.seqs:
            self.write(entry.seq, entry.num_tokens, garbage=True)
        self.scheduler.abandon(out)
        for entry in out.seqs:
            self.scheduler.finish(entry.seq, FinishReason.ERROR)
            self.live.remove(entry.seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.scheduler.finish(seq, data.draw(st.sampled_from([FinishReason.CANCELLED, FinishReason.ERROR])))
        self.live.remove(seq)

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.scheduler.preempt(data.draw(st.sampled_from(self.scheduler.running)))

    @rule(session=st.sampled_from(["a", "b", "c", "d"]))
    def delete_session(self, session: str) -> None:
        self.sessions.delete(session)

    @rule(dt=st.floats(0.0, 12.0))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "pool"):
            return
        owners = [seq.block_table for seq in self.scheduler.running] + self.sessions.owners()
        self.pool.check(owners)
        for seq in self.live:
            if seq.status is SeqStatus.WAITING:
                assert seq.block_table == []
        for seq in self.scheduler.running:
            # Blocks this sequence will still write into must be its alone (copy on write).
            for block in seq.block_table[seq.num_computed // BLOCK_SIZE :]:
                assert self.pool.ref_count[block] == 1
        assert self.sessions.num_blocks_held == sum(len(b) for b in self.sessions.owners())
        assert len(self.sessions) <= MAX_SESSIONS
        assert self.sessions.num_blocks_held <= int(self.pool.num_blocks * SESSION_POOL_FRACTION)
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs

    @invariant()
    def computed_kv_holds_its_tokens(self) -> None:
        """Whatever was reused, shared, copied or evicted: each token counted as computed is in its slot."""
        if not hasattr(self, "pool"):
            return
        held = [(seq.token_ids[: seq.num_computed], seq.block_table) for seq in self.scheduler.running]
        held += [(session.token_ids, session.blocks) for session in map(self.sessions.get, "abcd") if session]
        for tokens, table in held:
            slots = [self.kv[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(tokens))]
            assert slots == list(tokens)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for seq in list(self.live):
            self.scheduler.finish(seq, FinishReason.CANCELLED)
        while self.sessions.evict_one():
            pass
        self.pool.clear_cache()
        self.pool.check([])
        assert self.pool.num_free == self.pool.num_blocks
        assert not self.scheduler.running and self.scheduler.num_waiting == 0


TestEngineBooks = EngineBooks.TestCase
TestEngineBooks.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_requests_progress_to_completion_under_pressure() -> None:
    """With a pool that fits one request at a time, every request still finishes (preemption, no deadlock)."""
    pool = BlockPool(6, BLOCK_SIZE)
    sessions = SessionStore(pool, ttl_s=60, max_sessions=4, max_pool_fraction=1.0)
    scheduler = Scheduler(pool, sessions, max_num_seqs=4, max_num_batched_tokens=8)
    seqs = []
    for i in range(5):
        request = GenerationRequest(f"r{i}", tuple(range(10)), stopping=StoppingParams(max_new_tokens=8))
        seq = Sequence(request, list(range(10)), float(i), i)
        scheduler.add(seq)
        seqs.append(seq)
    for _ in range(500):
        if not scheduler.has_work:
            break
        out = scheduler.schedule()
        for seq in scheduler.update(out):
            seq.token_ids.append(1)
            if seq.num_generated >= 8:
                scheduler.finish(seq, FinishReason.LENGTH)
    assert all(seq.status is SeqStatus.FINISHED for seq in seqs)
    assert sum(seq.num_preemptions for seq in seqs) > 0
    pool.clear_cache()
    assert pool.num_free == pool.num_blocks


def test_session_reuse_and_copy_on_write() -> None:
    pool = BlockPool(32, BLOCK_SIZE)
    sessions = SessionStore(pool, ttl_s=60, max_sessions=4, max_pool_fraction=1.0)
    scheduler = Scheduler(pool, sessions, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)

    copies: list[tuple[int, int]] = []
    tables: dict[str, list[int]] = {}

    def run(rid: str, prompt: list[int]) -> Sequence:
        request = GenerationRequest(rid, tuple(prompt), stopping=StoppingParams(max_new_tokens=3), session_id="s")
        seq = Sequence(request, list(prompt), 0.0, int(rid[1:]))
        scheduler.add(seq)
        while seq.status is not SeqStatus.FINISHED:
            out = scheduler.schedule()
            copies.extend(out.copies)
            tables[rid] = list(seq.block_table)
            for ready in scheduler.update(out):
                ready.token_ids.append(5)
                if ready.num_generated >= 3:
                    scheduler.finish(ready, FinishReason.LENGTH)
        return seq

    first = run("r1", list(range(10)))  # 10 prompt + 3 generated, 12 computed
    assert sessions.get("s").token_ids == first.token_ids[:12]
    held = list(sessions.get("s").blocks)
    second = run("r2", first.token_ids + [9, 9])
    assert second.num_cached_prompt == 12  # 3 full blocks shared, nothing recomputed
    assert copies == [] and tables["r2"][:3] == held
    held = list(sessions.get("s").blocks)
    third = run("r3", first.token_ids[:6] + [8, 8])
    assert third.num_cached_prompt == 6  # one full block shared, the partial second one copied
    # The copy: the session's second block (tokens 4..7, of which 4..5 match) into the third call's own block.
    assert tables["r3"][0] == held[0]
    assert copies == [(held[1], tables["r3"][1])] and tables["r3"][1] not in held
    pool.check(sessions.owners())
