"""Property-based tests of the block pool, session store and scheduler together (no model, no tensors).

A state machine adds, steps, fails steps, aborts, finishes, preempts and deletes sessions in any order. It
keeps a shadow of the KV cache (what each slot holds, as the runner would have written it: a slot's KV depends on
its token and on every token before it, so the shadow holds that whole prefix), so after every rule it can check
what the engine relies on: every token a running sequence or a session counts as computed is in its slot, whatever
blocks were shared, copied, cached or reused. Also after every rule: the pool's books match the owners exactly,
writable blocks are exclusively owned, the running count, the session count and the sessions' pool share stay
within their limits; each step admits in priority order; and at the end everything comes back free.
"""

from __future__ import annotations

from collections import defaultdict

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmserve.engine.kv_tiers.index import TierIndex
from llmserve.engine.sched.block_pool import BlockContent, BlockPool, Evicted, chain_hash
from llmserve.engine.sched.plan import StepPlan
from llmserve.engine.sched.scheduler import POOLING_MIN_CHUNK, Scheduler
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.sched.sessions import SessionStore
from llmserve.engine.types.outputs import FinishReason
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import GenerationRequest, PoolingParams, StoppingParams
from tests.engine.engine_helpers import clear_cache
from tests.engine.sched.pool_checks import check_pool, pinned, session_owners

BLOCK_SIZE = 4
MAX_SESSIONS = 3
SESSION_POOL_FRACTION = 0.5
GARBAGE = -1  # what a failed forward may leave in the slots it was writing


def _held_back(seq: Sequence) -> bool:
    """A later completion whose first one has not computed the prompt (and is not finished): it may not start."""
    after = seq.after
    return after is not None and after.status is not SeqStatus.FINISHED and after.num_computed < after.num_prompt


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
        tier_blocks=st.sampled_from([8, 40, 2, 0]),
    )
    def setup(self, num_blocks: int, max_seqs: int, budget: int, prefix: bool, tier_blocks: int) -> None:
        self.clock = Clock()
        self.pool = BlockPool(num_blocks, BLOCK_SIZE, track_evictions=tier_blocks > 0)
        # A lower tier: the real index (LRU, bounded, content-checked) over a shadow of the KV it keeps.
        self.tier = TierIndex(tier_blocks, 1) if tier_blocks else None
        self.tier_kv: dict[bytes, list[tuple[int, ...] | int | None]] = {}
        self.loads: list[tuple[int, BlockContent]] = []
        self.past: list[tuple[list[int], str | None]] = []  # finished conversations, to come back to
        self.sessions = SessionStore(
            self.pool,
            ttl_s=10.0,
            max_sessions=MAX_SESSIONS,
            max_pool_fraction=SESSION_POOL_FRACTION,
            clock=self.clock,
        )
        self.scheduler = Scheduler(
            self.pool,
            self.sessions,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=prefix,
            tiers=self.tier,
        )
        self.live: list[Sequence] = []
        self.n = 0
        # block -> the prefix whose last token's KV each slot holds (None: never written since the pool began)
        self.kv: defaultdict[int, list[tuple[int, ...] | int | None]] = defaultdict(lambda: [None] * BLOCK_SIZE)

    # Prompts from a tiny alphabet with shared heads, so prefix and session reuse really happen.
    @rule(
        head=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [7] * 13, []]),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=14),
        max_new=st.integers(1, 6),
        session=st.sampled_from([None, "a", "b", "c", "d"]),
        priority=st.sampled_from([0, 0, 0, 1, 5, -2]),
        scored=st.sampled_from([False, False, True]),
    )
    def add(
        self, head: list[int], tail: list[int], max_new: int, session: str | None, priority: int, scored: bool
    ) -> None:
        self.add_prompt(head + tail, max_new, session, priority, scored)

    def add_prompt(
        self, prompt: list[int], max_new: int, session: str | None, priority: int = 0, scored: bool = False
    ) -> None:
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
            prompt_logprobs=scored,
        )
        seq = Sequence(request, list(prompt), float(self.n), self.n)
        self.scheduler.add(seq)
        self.live.append(seq)

    @precondition(lambda self: any(s.request.session_id is None for s in self.live))
    @rule(data=st.data(), count=st.integers(1, 3))
    def fork(self, data: st.DataObject, count: int) -> None:
        """More completions of a live request's prompt (n > 1): each waits for that one's prompt KV, then shares it."""
        first = data.draw(st.sampled_from([s for s in self.live if s.request.session_id is None]))
        for _ in range(count):
            if len(self.live) >= 8:
                return
            self.n += 1
            request = first.request
            seq = Sequence(request, list(request.prompt_token_ids), float(self.n), self.n, after=first)
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

    @precondition(lambda self: self.past)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def come_back(self, data: st.DataObject, extra: list[int]) -> None:
        """A conversation returns after its session (and maybe its cached blocks) went: a tier may hold its KV."""
        tokens, session = data.draw(st.sampled_from(self.past))
        self.add_prompt(tokens + extra, 2, session)

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> StepPlan:
        """One schedule() call, checked for admission order and the running-count limit."""
        waiting = [seq for seq in self.live if seq.status is SeqStatus.WAITING]
        out = self.scheduler.schedule(drafts) if drafts is not None else self.scheduler.schedule()
        admitted = [seq for seq in waiting if seq.status is SeqStatus.RUNNING]
        # A sequence whose KV loads waits without holding up the others: it is outside the order.
        left = [seq for seq in waiting if seq.status is SeqStatus.WAITING and not self.scheduler.is_loading(seq)]
        # So does a later completion of an n > 1 request while its first one has not computed the prompt.
        assert not any(map(_held_back, admitted))
        # A sequence that scores its prompt (prompt logprobs, before its first token) reads no cached KV: it starts at
        # position 0 at every admission, preemptions included.
        assert all(entry.start == 0 for entry in out.seqs if entry.seq.scores_prompt and entry.seq in admitted)
        left = [seq for seq in left if not _held_back(seq)]
        # What the core does before the forward: copy out the evicted blocks' KV, start the loads.
        for evicted in out.offloads:
            self.offload(evicted)  # its KV is intact until the forward (even if a preemption freed it again)
        for block, _ in out.loads:
            assert self.pool.is_loading(block) and self.pool.block_hash[block] is None
        self.loads += out.loads

        def order(seq: Sequence) -> tuple[int, int]:
            return (-seq.request.priority, seq.seq_no)

        # Higher priority first, then age; a preempted sequence keeps its age.
        if admitted and left:
            assert max(map(order, admitted)) < min(map(order, left))
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        return out

    def offload(self, evicted: Evicted) -> None:
        """What the tier worker does with an evicted block: keep a copy of its KV, LRU-bounded."""
        assert self.tier is not None
        self.tier_kv[evicted.content.block_hash] = list(self.kv[evicted.block])
        for gone in self.tier.add(evicted.content):
            self.tier_kv.pop(gone, None)

    def write(self, seq: Sequence, n: int, garbage: bool = False) -> None:
        """What the forward writes: the KV of the sequence's next n tokens, into its own slots."""
        for p in range(seq.num_computed, seq.num_computed + n):
            slot = GARBAGE if garbage else tuple(seq.token_ids[: p + 1])
            self.kv[seq.block_table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = slot

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
            assert entry.block_table is seq.block_table
            # It samples exactly when the step reaches its last token.
            assert (entry.sample is not None) == (entry.end == len(seq.token_ids))
            assert len(seq.block_table) >= self.pool.blocks_for(seq.num_computed + n)
            # The blocks this step writes into belong to this sequence alone (copy on write); a block may also be a
            # copy's source this step (pinned until the step is accounted): the copies are made before the forward.
            pins = [src for src, _ in out.copies]
            for block in seq.block_table[seq.num_computed // BLOCK_SIZE : self.pool.blocks_for(seq.num_computed + n)]:
                assert self.pool.ref_count[block] == 1 + pins.count(block)
        assert out.num_tokens <= self.scheduler.max_num_batched_tokens
        for entry in out.seqs:
            self.write(entry.seq, entry.num_tokens)
        ready = self.scheduler.update(out)
        for seq in ready:
            seq.token_ids.append(token)
            if seq.first_token is None:
                seq.first_token = self.clock.now  # as the token sink does: its prompt's scores went out with it
            if seq.num_generated >= seq.request.stopping.max_new_tokens:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                self.live.remove(seq)
                self.past = (self.past + [(list(seq.token_ids), seq.request.session_id)])[-6:]

    @rule(data=st.data(), token=st.integers(0, 3))
    def verify_step(self, data: st.DataObject, token: int) -> None:
        """A step in which decoding sequences verify drafts (speculative decoding): each gets a random guess, the
        sampler accepts a random prefix of it and adds its own token; the KV of the rejected drafts must be
        dropped (computed_kv_holds_its_tokens: no position counted as computed holds a draft's KV)."""
        decoding = [seq for seq in self.scheduler.running if seq.num_uncomputed == 1]
        guesses = st.lists(st.integers(0, 3), min_size=1, max_size=2 * BLOCK_SIZE)
        drafts = {seq.seq_no: data.draw(guesses) for seq in decoding}
        out = self.schedule(drafts)  # a draft step also admits, offloads and starts loads like any other
        for entry in out.seqs:
            seq = entry.seq
            if entry.drafts:
                assert list(entry.drafts) == drafts[seq.seq_no] and entry.sample is not None
                assert list(entry.token_ids) == [seq.token_ids[entry.start], *entry.drafts]
                assert len(seq.block_table) >= self.pool.blocks_for(entry.end)
        for src, dst in out.copies:
            self.kv[dst] = list(self.kv[src])
        for entry in out.seqs:
            seq = entry.seq
            for p in range(entry.start, entry.end):  # with drafts: the KV of the guessed context
                context = (seq.token_ids[: entry.start] + list(entry.token_ids))[: p + 1]
                self.kv[seq.block_table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = tuple(context)
        ready = self.scheduler.update(out)
        verified = {entry.seq.seq_no: entry for entry in out.seqs if entry.drafts}
        for seq in ready:
            entry = verified.get(seq.seq_no)
            accepted = data.draw(st.integers(0, len(entry.drafts))) if entry is not None else 0
            emitted = (list(entry.drafts[:accepted]) if entry is not None else []) + [token]
            left = seq.request.stopping.max_new_tokens - seq.num_generated
            seq.token_ids.extend(emitted[:left])
            if entry is not None:
                self.scheduler.settle_drafts(entry, min(accepted, left - 1))
                assert seq.num_computed == len(seq.token_ids) - 1
                assert len(seq.block_table) == self.pool.blocks_for(seq.num_computed)
            if seq.num_generated >= seq.request.stopping.max_new_tokens:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                self.live.remove(seq)
                self.past = (self.past + [(list(seq.token_ids), seq.request.session_id)])[-6:]

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

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), ok=st.sampled_from([True, True, False]))
    def finish_load(self, data: st.DataObject, ok: bool) -> None:
        """A load ends: the tier's KV arrives, or the load fails (a corrupt, truncated or vanished block)."""
        block, content = data.draw(st.sampled_from(self.loads))
        self.loads.remove((block, content))
        stored = self.tier_kv.get(content.block_hash)
        ok = ok and stored is not None
        # A failed read may leave anything behind in the block.
        self.kv[block] = list(stored) if ok and stored is not None else [GARBAGE] * BLOCK_SIZE
        self.scheduler.load_done(block, ok)
        assert not self.pool.is_loading(block)

    @precondition(lambda self: self.pool.num_cached > 0 or len(self.sessions) > 0)
    @rule(n=st.integers(1, 40), drop_sessions=st.booleans())
    def squeeze(self, n: int, drop_sessions: bool) -> None:
        """Something else takes free blocks for a while (as a burst of requests would), evicting cached ones (and
        maybe every idle session first): their KV goes to the tier before it is overwritten."""
        while drop_sessions and self.sessions.evict_one():
            pass
        taken = self.pool.allocate(min(n, self.pool.num_free))
        for evicted in self.pool.take_evicted():
            self.offload(evicted)
        for block in taken:
            self.kv[block] = [GARBAGE] * BLOCK_SIZE
        self.pool.release(taken)

    @precondition(lambda self: self.tier_kv)
    @rule(data=st.data())
    def lose_tier_block(self, data: st.DataObject) -> None:
        """A block file is deleted or corrupted under the server: the index still lists it, its loads fail."""
        del self.tier_kv[data.draw(st.sampled_from(sorted(self.tier_kv)))]

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
        owners = [seq.block_table for seq in self.scheduler.running] + session_owners(self.sessions)
        check_pool(self.pool, owners + pinned(self.scheduler))
        assert len(self.pool._loading) == len(self.loads) == len(self.scheduler._load_content)
        if self.tier is not None:
            assert len(self.tier) <= self.tier.capacity_blocks
            assert all(self.tier.get(block_hash) is not None for block_hash in self.tier_kv)
            for block_hash, kv in self.tier_kv.items():
                # What a tier keeps is what the block held when it was evicted: its tokens' KV.
                content = self.tier.get(block_hash)
                assert content is not None
                assert chain_hash(content.parent, content.tokens) == block_hash
                assert kv[-1] is not None and kv[-1] != GARBAGE and kv[-1][-BLOCK_SIZE:] == content.tokens
        for seq in self.live:
            if seq.status is SeqStatus.WAITING:
                assert seq.block_table == []
        for seq in self.scheduler.running:
            # Blocks this sequence will still write into must be its alone (copy on write).
            for block in seq.block_table[seq.num_computed // BLOCK_SIZE :]:
                assert self.pool.ref_count[block] == 1
        assert self.sessions.num_blocks_held == sum(len(b) for b in session_owners(self.sessions))
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
            assert slots == [tuple(tokens[: p + 1]) for p in range(len(tokens))]

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for seq in list(self.live):
            self.scheduler.finish(seq, FinishReason.CANCELLED)
        for block, _ in self.loads:
            self.scheduler.load_done(block, False)
        while self.sessions.evict_one():
            pass
        clear_cache(self.pool)
        check_pool(self.pool, [])
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
    clear_cache(pool)
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
    check_pool(pool, session_owners(sessions))


# -- targeted cases: the counters the metrics read, and rules the state machine cannot see ----------------------------


def books(
    num_blocks: int = 32, *, max_seqs: int = 4, budget: int = 64, prefix: bool = True, ttl_s: float = 60.0
) -> tuple[BlockPool, SessionStore, Scheduler, Clock]:
    clock = Clock()
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    sessions = SessionStore(pool, ttl_s=ttl_s, max_sessions=4, max_pool_fraction=1.0, clock=clock)
    scheduler = Scheduler(
        pool, sessions, max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_prefix_caching=prefix
    )
    return pool, sessions, scheduler, clock


def new_seq(n: int, prompt: list[int], *, max_new: int = 2, session: str | None = None, priority: int = 0) -> Sequence:
    request = GenerationRequest(
        f"r{n}", tuple(prompt), stopping=StoppingParams(max_new_tokens=max_new), session_id=session, priority=priority
    )
    return Sequence(request, list(prompt), float(n), n)


def drive(scheduler: Scheduler, *seqs: Sequence, add: bool = True, token: int = 3) -> None:
    """Add the sequences (unless they are in already) and step until they finish (each after its max_new_tokens)."""
    for seq in seqs if add else ():
        scheduler.add(seq)
    for _ in range(100):
        if all(seq.status is SeqStatus.FINISHED for seq in seqs):
            return
        for ready in scheduler.update(scheduler.schedule()):
            ready.token_ids.append(token)
            if ready.num_generated >= ready.request.stopping.max_new_tokens:
                scheduler.finish(ready, FinishReason.LENGTH)
    raise AssertionError("the sequences did not finish")


def test_counters_for_session_hits_misses_and_prefix_cache_hits() -> None:
    _, _, scheduler, _ = books()
    system = list(range(20, 32))  # three full blocks
    drive(scheduler, new_seq(1, system + [1], session="s"))
    assert (scheduler.num_session_hits, scheduler.num_session_misses, scheduler.num_prefix_cache_hits) == (0, 1, 0)
    drive(scheduler, new_seq(2, system + [1, 3, 5]))  # no session: the prefix cache
    assert (scheduler.num_session_hits, scheduler.num_session_misses, scheduler.num_prefix_cache_hits) == (0, 1, 1)
    drive(scheduler, new_seq(7, system + [4]))
    assert scheduler.num_prefix_cache_hits == 2
    drive(scheduler, new_seq(3, system + [1, 3, 7], session="s"))
    drive(scheduler, new_seq(4, system + [2], session="s"))
    assert (scheduler.num_session_hits, scheduler.num_session_misses, scheduler.num_prefix_cache_hits) == (2, 1, 2)
    drive(scheduler, new_seq(5, [9, 9], session="t"), new_seq(6, [8, 8]))  # nothing to reuse: no hit at all
    assert (scheduler.num_session_hits, scheduler.num_session_misses, scheduler.num_prefix_cache_hits) == (2, 2, 2)


def test_preemption_is_counted_and_a_preempted_sequence_is_not_counted_again() -> None:
    pool, _, scheduler, _ = books(num_blocks=4, budget=16)
    first, second = new_seq(1, list(range(8)), max_new=4), new_seq(2, list(range(50, 58)), max_new=4, session="a")
    scheduler.add(first)
    scheduler.add(second)
    for ready in scheduler.update(scheduler.schedule()):  # both prompts fill the pool (2 blocks each)
        ready.token_ids.append(7)
    assert [s.seq_no for s in scheduler.running] == [1, 2] and pool.num_free == 0
    plan = scheduler.schedule()  # first needs a third block: the newest running sequence makes way
    assert plan.preempted == [second] and scheduler.num_preemptions == 1 and second.num_preemptions == 1
    assert second.status is SeqStatus.WAITING and second.block_table == [] and second.num_computed == 0
    assert scheduler.num_waiting == 1 and scheduler.has_work
    scheduler.finish(first, FinishReason.CANCELLED)
    drive(scheduler, second, add=False)
    assert (scheduler.num_session_hits, scheduler.num_session_misses) == (0, 1)  # counted at its first admission
    assert scheduler.num_preemptions == 1 and not scheduler.has_work and scheduler.num_waiting == 0


def test_idle_sessions_expire_at_each_schedule_also_without_prefix_caching() -> None:
    _, sessions, scheduler, clock = books(prefix=False, ttl_s=5.0)
    drive(scheduler, new_seq(1, [1, 2, 3, 4, 5], session="s"))
    assert "s" in sessions
    clock.now += 6
    scheduler.schedule()
    assert "s" not in sessions and sessions.evictions["ttl"] == 1


def test_a_request_that_computed_nothing_leaves_no_session() -> None:
    pool, sessions, scheduler, _ = books()
    waiting = new_seq(1, [1, 2, 3], session="s")
    scheduler.add(waiting)
    assert scheduler.num_waiting == 1
    scheduler.finish(waiting, FinishReason.CANCELLED)
    assert "s" not in sessions and scheduler.num_waiting == 0 and not scheduler.has_work
    scheduler.finish(waiting, FinishReason.CANCELLED)  # a second finish changes nothing
    assert scheduler.num_waiting == 0 and waiting.finish_reason is FinishReason.CANCELLED
    assert scheduler.schedule().seqs == []  # its heap entry is dropped
    ahead, behind = new_seq(3, [1, 2], priority=1), new_seq(4, [3, 4])
    scheduler.add(ahead)
    scheduler.add(behind)
    scheduler.finish(ahead, FinishReason.CANCELLED)  # aborted at the head of the queue: the next one goes on
    assert [entry.seq for entry in scheduler.schedule().seqs] == [behind]
    scheduler.finish(behind, FinishReason.CANCELLED)
    failed = new_seq(2, [1, 2, 3, 4, 5], session="t")
    scheduler.add(failed)
    scheduler.update(scheduler.schedule())
    scheduler.finish(failed, FinishReason.ERROR)  # computed, but its KV is not to be trusted
    assert "t" not in sessions and pool.num_free == pool.num_blocks


def test_a_finished_session_keeps_the_blocks_of_its_computed_tokens_only() -> None:
    pool, sessions, scheduler, _ = books(prefix=False)
    seq = new_seq(1, list(range(7)), max_new=2, session="s")
    drive(scheduler, seq)  # 7 + 2 tokens, the last one never computed: 8 computed, two full blocks
    assert sessions.get("s").token_ids == list(range(7)) + [3] and len(sessions.get("s").blocks) == 2
    assert seq.block_table == [] and seq.finish_reason is FinishReason.LENGTH
    check_pool(pool, session_owners(sessions))


def test_waiting_sequences_are_admitted_by_priority_then_age_within_max_num_seqs() -> None:
    _, _, scheduler, _ = books(max_seqs=2)
    seqs = [new_seq(1, [1, 2]), new_seq(2, [3, 4], priority=5), new_seq(3, [5, 6]), new_seq(4, [7, 8], priority=5)]
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [entry.seq.seq_no for entry in plan.seqs] == [2, 4] and scheduler.num_waiting == 2
    scheduler.finish(seqs[1], FinishReason.CANCELLED)
    plan = scheduler.schedule()
    assert [entry.seq.seq_no for entry in plan.seqs] == [4, 1]


def test_the_token_budget_chunks_a_long_prompt_and_serves_running_sequences_first() -> None:
    _, _, scheduler, _ = books(budget=8)
    short, long = new_seq(1, [1, 2, 3]), new_seq(2, list(range(100, 120)))
    scheduler.add(short)
    scheduler.add(long)
    plan = scheduler.schedule()
    assert [(e.seq.seq_no, e.start, e.num_tokens) for e in plan.seqs] == [(1, 0, 3), (2, 0, 5)]
    assert plan.seqs[0].sample is not None and plan.seqs[1].sample is None
    for ready in scheduler.update(plan):
        ready.token_ids.append(9)
    plan = scheduler.schedule()
    assert [(e.seq.seq_no, e.start, e.num_tokens) for e in plan.seqs] == [(1, 3, 1), (2, 5, 7)]


def test_an_abandoned_step_lets_go_of_its_copy_sources_and_registers_nothing() -> None:
    pool, sessions, scheduler, _ = books()
    drive(scheduler, new_seq(1, list(range(6)), session="s"))  # 6 + 2: the session holds 7 tokens, blocks 0-1
    held = list(sessions.get("s").blocks)
    seq = new_seq(2, list(range(6)) + [9, 9, 9, 9, 9], session="s")  # diverges inside the second block
    scheduler.add(seq)
    plan = scheduler.schedule()
    assert plan.copies == [(held[1], seq.block_table[1])] and pool.ref_count[held[1]] == 2
    scheduler.abandon(plan)
    assert pool.ref_count[held[1]] == 1
    assert all(pool.block_hash[b] is None for b in seq.block_table[1:])
    scheduler.finish(seq, FinishReason.ERROR)
    check_pool(pool, session_owners(sessions))


def test_a_running_sequence_evicts_as_many_sessions_as_its_chunk_needs() -> None:
    pool, sessions, scheduler, _ = books(num_blocks=6, budget=8)
    for i, name in enumerate("wxyz"):
        drive(scheduler, new_seq(i, [i + 1, 2, 3], max_new=1, session=name))  # one block each
    assert len(sessions) == 4 and pool.num_free == 2
    long = new_seq(9, list(range(100, 116)))
    scheduler.add(long)
    scheduler.update(scheduler.schedule())  # the first 8 tokens: the 2 free blocks
    plan = scheduler.schedule()  # the next 8 need 2 more blocks: two sessions make way, nothing is preempted
    assert [(e.seq, e.num_tokens) for e in plan.seqs] == [(long, 8)] and plan.preempted == []
    assert sorted(sessions._sessions) == ["y", "z"] and len(long.block_table) == 4


def test_prefix_reuse_counts_every_full_block_of_the_prompt_but_the_last_token() -> None:
    _, _, scheduler, _ = books()
    system = list(range(20, 32))  # three full blocks
    drive(scheduler, new_seq(1, system + [1]))
    again = new_seq(2, system + [1, 3, 5])
    drive(scheduler, again)
    assert again.num_cached_prompt == 12
    one_more = new_seq(4, system + [2])  # one token past the blocks: all three reused
    drive(scheduler, one_more)
    assert one_more.num_cached_prompt == 12
    whole = new_seq(3, system)  # the prompt's last token is always computed: two blocks reused
    drive(scheduler, whole)
    assert whole.num_cached_prompt == 8


def test_a_block_is_hashed_only_once_it_is_full() -> None:
    """A sequence's last, partial block must not be looked up by the hash of the tokens it held at admission: after a
    preemption it is re-admitted with more tokens, which must match a cached block's content exactly."""
    pool, _, scheduler, _ = books(num_blocks=16)
    first = new_seq(1, [1, 2, 3, 4, 5, 6], max_new=3)
    drive(scheduler, first, token=7)  # computes [1..6, 7, 7]: blocks [1 2 3 4] [5 6 7 7] cached
    other = new_seq(2, [1, 2, 3, 4, 5, 6], max_new=4)
    scheduler.add(other)
    for _ in range(3):  # generates 9 and 9: [1..6, 9, 9, 9], 8 computed
        for ready in scheduler.update(scheduler.schedule()):
            ready.token_ids.append(9)
    scheduler.preempt(other)
    scheduler.schedule()  # re-admitted: its second block must be one that holds 5 6 9 9 (its own, cached), not 5 6 7 7
    head = chain_hash(None, [1, 2, 3, 4])
    assert other.num_computed == 8 and pool.block_hash[other.block_table[1]] == chain_hash(head, [5, 6, 9, 9])
    scheduler.finish(other, FinishReason.CANCELLED)
    check_pool(pool, [])


def test_a_prefix_hit_whose_tokens_differ_is_recomputed_not_reused() -> None:
    """A digest that matched another prompt's block (planted in the index: BLAKE2b-128 cannot be made to collide)
    must not hand that block's KV to this prompt: the hit is checked against the block's tokens and parent."""
    pool, _, scheduler, _ = books(num_blocks=16)
    victim = new_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_new=1)
    drive(scheduler, victim)
    attacker = new_seq(2, [4, 3, 2, 1, 8, 7, 6, 5, 9], max_new=1)
    for tokens, parent in (([1, 2, 3, 4], None), ([5, 6, 7, 8], chain_hash(None, [1, 2, 3, 4]))):
        block = pool.lookup(chain_hash(parent, tokens), parent, tokens)
        assert block is not None
        forged = chain_hash(chain_hash(None, [4, 3, 2, 1]) if parent else None, tokens[::-1])
        pool._hash_to_block[forged] = block
    drive(scheduler, attacker)
    assert attacker.num_cached_prompt == 0 and pool.num_hash_mismatches == 1


def test_a_one_token_prompt_leaves_a_one_token_session() -> None:
    _, sessions, scheduler, _ = books()
    drive(scheduler, new_seq(1, [5], max_new=1, session="s"))
    assert sessions.get("s").token_ids == [5] and len(sessions.get("s").blocks) == 1


def test_each_preemption_is_counted() -> None:
    _, _, scheduler, _ = books()
    seq = new_seq(1, [1, 2, 3])
    scheduler.add(seq)
    for expected in (1, 2):
        scheduler.schedule()
        scheduler.preempt(seq)
        assert seq.num_preemptions == expected and scheduler.num_preemptions == expected


def test_without_prefix_caching_nothing_is_kept_for_reuse() -> None:
    pool, _, scheduler, _ = books(prefix=False)
    seq = new_seq(1, list(range(10)), max_new=4)
    drive(scheduler, seq)
    assert pool.num_cached == 0 and all(h is None for h in pool.block_hash) and seq.block_hashes == []
    again = new_seq(2, list(range(10)))
    drive(scheduler, again)
    assert again.num_cached_prompt == 0


def test_the_newest_running_sequence_makes_way_even_when_it_is_the_one_growing() -> None:
    pool, _, scheduler, _ = books(num_blocks=6, budget=64)
    a, b, c = new_seq(1, list(range(7)), max_new=8), new_seq(2, list(range(8)), max_new=8), new_seq(3, [1, 2, 3, 4])
    for seq in (a, b, c):
        scheduler.add(seq)
    for ready in scheduler.update(scheduler.schedule()):  # 2 + 2 + 1 blocks
        ready.token_ids.append(5)
    # a has room in its last block, b needs a third block and c a second: only one is free.
    plan = scheduler.schedule()
    assert [entry.seq for entry in plan.seqs] == [a, b] and plan.preempted == [c]  # the newest went, not b
    assert c.status is SeqStatus.WAITING and c.block_table == [] and len(b.block_table) == 3
    for ready in scheduler.update(plan):
        ready.token_ids.append(5)
    check_pool(pool, [a.block_table, b.block_table])


def test_a_sequence_that_must_preempt_itself_leaves_the_step() -> None:
    pool, _, scheduler, _ = books(num_blocks=4, budget=64)
    older, newer = new_seq(1, list(range(7)), max_new=8), new_seq(2, list(range(8)), max_new=8)
    scheduler.add(older)
    scheduler.add(newer)
    for ready in scheduler.update(scheduler.schedule()):  # 2 blocks each: the pool is full
        ready.token_ids.append(5)
    plan = scheduler.schedule()  # older fits its next token; newer needs a block and is the newest itself
    assert isinstance(plan, StepPlan)
    assert [(entry.seq, entry.num_tokens) for entry in plan.seqs] == [(older, 1)] and plan.preempted == [newer]
    assert newer.status is SeqStatus.WAITING and newer.block_table == [] and scheduler.running == [older]
    check_pool(pool, [older.block_table])


def test_a_waiting_request_evicts_sessions_and_waits_when_running_ones_hold_the_pool() -> None:
    pool, sessions, scheduler, _ = books(num_blocks=4, budget=64)
    drive(scheduler, new_seq(1, list(range(7)), max_new=1, session="a"), new_seq(2, [9] * 7, max_new=1, session="b"))
    assert len(sessions) == 2 and pool.num_free == 0 and pool.num_cached == 0
    first = new_seq(3, list(range(20, 27)), max_new=20)
    scheduler.add(first)
    plan = scheduler.schedule()
    assert [entry.seq for entry in plan.seqs] == [first]  # one session made way
    assert sorted(sessions._sessions) == ["b"]
    for ready in scheduler.update(plan):
        ready.token_ids.append(5)
    second = new_seq(4, list(range(30, 39)))  # needs 3 blocks: evicting "b" frees only 2
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [entry.seq for entry in plan.seqs] == [first] and second.status is SeqStatus.WAITING
    assert second.block_table == [] and scheduler.num_waiting == 1 and len(sessions) == 0
    check_pool(pool, [first.block_table])


def test_the_budget_is_spent_to_the_last_token_and_no_further() -> None:
    _, _, scheduler, _ = books(budget=8)
    decoding, prompt = new_seq(1, [1, 2, 3], max_new=8), new_seq(2, list(range(100, 107)))
    scheduler.add(decoding)
    for ready in scheduler.update(scheduler.schedule()):
        ready.token_ids.append(5)
    scheduler.add(prompt)
    plan = scheduler.schedule()  # one decode token, then seven prompt tokens: the budget is spent exactly
    assert [(e.seq, e.num_tokens) for e in plan.seqs] == [(decoding, 1), (prompt, 7)]
    for ready in scheduler.update(plan):
        ready.token_ids.append(5)
    late = new_seq(3, [4, 5, 6])
    scheduler.add(late)
    long = new_seq(4, list(range(200, 215)))
    scheduler.add(long)
    plan = scheduler.schedule()  # 1 + 1 + 3, then 3 of long's 15: 8
    assert [(e.seq, e.num_tokens) for e in plan.seqs] == [(decoding, 1), (prompt, 1), (late, 3), (long, 3)]
    for ready in scheduler.update(plan):
        ready.token_ids.append(5)
    waiting = new_seq(5, [7, 7])
    scheduler.add(waiting)
    plan = scheduler.schedule()  # 1 + 1 + 1, then long's next 5: nothing left for the one waiting
    assert [(e.seq, e.num_tokens) for e in plan.seqs] == [(decoding, 1), (prompt, 1), (late, 1), (long, 5)]
    assert waiting.status is SeqStatus.WAITING and waiting.block_table == []


def test_the_longer_of_session_and_prefix_reuse_wins() -> None:
    _, sessions, scheduler, _ = books()
    system = list(range(20, 32))
    drive(scheduler, new_seq(1, system[:5], max_new=2, session="s"))  # the session holds 6 tokens of the system
    drive(scheduler, new_seq(2, system + [1]))  # the prefix cache holds all three blocks
    both = new_seq(3, system + [2], session="s")
    drive(scheduler, both)
    assert both.num_cached_prompt == 12


def test_prefix_caching_is_on_by_default() -> None:
    pool = BlockPool(16, BLOCK_SIZE)
    scheduler = Scheduler(
        pool,
        SessionStore(pool, ttl_s=60, max_sessions=4, max_pool_fraction=1.0),
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )
    drive(scheduler, new_seq(1, list(range(9))))
    again = new_seq(2, list(range(9)))
    drive(scheduler, again)
    assert again.num_cached_prompt == 8


def test_the_last_token_of_the_budget_is_spent_on_admission_and_on_decode() -> None:
    _, _, scheduler, _ = books(budget=3)
    seqs = [new_seq(i, [i + 1], max_new=4) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()  # one token each: the third one gets the budget's last token
    assert [(e.seq, e.num_tokens) for e in plan.seqs] == [(seq, 1) for seq in seqs]
    for ready in scheduler.update(plan):
        ready.token_ids.append(5)
    plan = scheduler.schedule()
    assert [(e.seq, e.num_tokens) for e in plan.seqs] == [(seq, 1) for seq in seqs]


def test_the_prefix_cache_is_shared_only_under_the_same_salt() -> None:
    _, _, scheduler, _ = books()
    prompt = list(range(20, 33))  # three full blocks and a token

    def cached(n: int, salt: str | None) -> int:
        request = GenerationRequest(f"r{n}", tuple(prompt), stopping=StoppingParams(max_new_tokens=1), cache_salt=salt)
        seq = Sequence(request, list(prompt), float(n), n)
        drive(scheduler, seq)
        return seq.num_cached_prompt

    assert cached(1, "alice") == 0
    assert cached(2, "bob") == 0 and cached(3, None) == 0  # another salt, or none: nothing shared
    assert cached(4, "alice") == 12 and cached(5, "bob") == 12 and cached(6, None) == 12


def test_a_later_completion_shares_only_the_first_ones_full_prompt_blocks_also_after_preemption() -> None:
    """Without prefix caching a later completion takes completion 0's own blocks: it shares only those full of
    prompt and copies the one where completion 0's generated tokens begin (copy-on-write), also once it has more
    tokens of its own (readmitted)."""
    pool = BlockPool(20, BLOCK_SIZE)
    sessions = SessionStore(pool, ttl_s=60, max_sessions=4, max_pool_fraction=1.0)
    scheduler = Scheduler(pool, sessions, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompt = list(range(10))  # two full blocks of 4 and a tail of 2
    request = GenerationRequest("r", tuple(prompt), stopping=StoppingParams(max_new_tokens=20))
    first = Sequence(request, list(prompt), 0.0, 0)
    later = Sequence(request, list(prompt), 0.0, 1, after=first)
    scheduler.add(first)
    scheduler.add(later)

    def step(token: int) -> None:
        for seq in scheduler.update(scheduler.schedule()):
            seq.token_ids.append(token if seq is first else token + 100)

    step(1)
    assert later.status is SeqStatus.WAITING  # held back until the prompt was computed: it was, this step
    plan = scheduler.schedule()
    assert [entry.seq for entry in plan.seqs if entry.seq is later] == [later]
    assert plan.copies == [(first.block_table[2], later.block_table[2])]  # the prompt's partial block, copied
    for seq in scheduler.update(plan):
        seq.token_ids.append(2 if seq is first else 102)
    assert later.status is SeqStatus.RUNNING and later.num_cached_prompt == 9  # all of the prompt but its last token
    assert later.block_table[:2] == first.block_table[:2] and pool.ref_count[first.block_table[0]] == 2
    for token in range(3, 8):
        step(token)
    assert later.num_generated >= 4 and first.num_computed >= 14
    scheduler.preempt(later)
    step(9)
    assert later.status is SeqStatus.RUNNING
    assert later.block_table[:2] == first.block_table[:2] and later.block_table[2] != first.block_table[2]
    check_pool(pool, [first.block_table, later.block_table])


def scoring_seq(n: int, prompt: list[int], *, session: str | None = None) -> Sequence:
    """A request that asks for its prompt's logprobs."""
    stopping = StoppingParams(max_new_tokens=2)
    request = GenerationRequest(f"r{n}", tuple(prompt), stopping=stopping, session_id=session, prompt_logprobs=True)
    return Sequence(request, list(prompt), float(n), n)


def test_prompt_logprobs_read_no_cached_prefix_and_what_they_compute_is_cached() -> None:
    _, _, scheduler, _ = books()
    prompt = list(range(20, 33))  # three full blocks and a token
    drive(scheduler, new_seq(1, prompt))
    scored = scoring_seq(2, prompt)
    scheduler.add(scored)
    plan = scheduler.schedule()
    assert scored.num_cached_prompt == 0 and plan.seqs[0].start == 0
    assert plan.seqs[0].scored_positions == range(0, len(prompt) - 1)
    drive(scheduler, scored, add=False)
    # A prompt scored first: its full blocks enter the prefix cache, and a plain request after it reuses them.
    fresh = list(range(40, 53))
    drive(scheduler, scoring_seq(3, fresh))
    plain = new_seq(4, fresh)
    drive(scheduler, plain)
    assert plain.num_cached_prompt == 12


def test_prompt_logprobs_skip_the_session_and_start_over_after_a_preemption_until_the_first_token() -> None:
    _, sessions, scheduler, _ = books(budget=8)
    drive(scheduler, new_seq(1, list(range(20, 30)), session="s"))
    turn = sessions.get("s").token_ids + [7, 8]
    scored = scoring_seq(2, turn, session="s")
    scheduler.add(scored)
    first = scheduler.schedule()
    assert scored.num_cached_prompt == 0 and first.seqs[0].scored_positions == range(0, 8)
    scheduler.update(first)
    assert scheduler.schedule().seqs[0].scored_positions == range(8, len(turn) - 1)  # chunked: the rest
    scheduler.preempt(scored)
    again = scheduler.schedule()
    assert again.seqs[0].start == 0 and again.seqs[0].scored_positions == range(0, 8)  # its cached blocks unread
    scheduler.update(again)
    scored.first_token = 1.0  # its first token (and the scores with it) went out: from now on it reuses as any
    scheduler.preempt(scored)
    late = scheduler.schedule()
    assert late.seqs[0].start >= 8 and late.seqs[0].scored_positions is None  # its cached blocks, or the session
    scheduler.finish(scored, FinishReason.CANCELLED)


def _pooling_seq(n: int, prompt: list[int]) -> Sequence:
    request = GenerationRequest(
        f"p{n}", tuple(prompt), stopping=StoppingParams(max_new_tokens=1), pooling=PoolingParams(PoolingMode.LAST)
    )
    return Sequence(request, list(prompt), float(n), n)


def test_pooling_takes_its_share_of_a_step_while_generation_runs_and_the_budget_without() -> None:
    """With pooling_share 0.2, eight decoding sequences leave a pooling request 8 * 0.25 = 2 tokens a step (its
    prompt read in chunks, never stalled); a generating request behind a capped pooling one is admitted past it;
    once generation is over, pooling takes the whole budget."""
    pool = BlockPool(64, BLOCK_SIZE)
    sessions = SessionStore(pool, ttl_s=60.0, max_sessions=4, max_pool_fraction=1.0, clock=Clock())
    scheduler = Scheduler(pool, sessions, max_num_seqs=16, max_num_batched_tokens=64, pooling_share=0.2)
    assert scheduler.pooling_cap() is None  # nothing generates
    streams = [new_seq(n, [n, n + 1], max_new=30) for n in range(8)]
    for seq in streams:
        scheduler.add(seq)
    for ready in scheduler.update(scheduler.schedule()):  # the streams' prompts
        ready.token_ids.append(3)
    pooled, first, second = _pooling_seq(20, list(range(100, 130))), _pooling_seq(21, [7] * 10), new_seq(22, [5, 6])
    for seq in (pooled, first, second):
        scheduler.add(seq)
    assert scheduler.pooling_cap() == 2
    plan = scheduler.schedule()
    taken = {e.seq.seq_no: e.num_tokens for e in plan.seqs}
    assert taken[20] == 2 and 21 not in taken  # the cap spent on the oldest pooling request; the other waits
    assert taken[22] == 2  # generation behind them is admitted all the same
    assert first.status is SeqStatus.WAITING
    read = [2]  # each step's tokens of the pooling requests, never past the cap computed before it, never none
    while pooled.num_computed < 30:
        for ready in scheduler.update(plan):
            if ready.request.pooling is None:
                ready.token_ids.append(3)
        cap = scheduler.pooling_cap()
        assert cap in (2, 3)  # 8 streams, then 9 with the one admitted past the pooling requests
        plan = scheduler.schedule()
        read.append(sum(e.num_tokens for e in plan.seqs if e.seq.request.pooling is not None))
        assert 1 <= read[-1] <= cap
    assert sum(read) >= 30 and len(read) >= 10
    for seq in [*streams, second]:
        scheduler.finish(seq, FinishReason.LENGTH)
    scheduler.finish(pooled, FinishReason.LENGTH)
    assert scheduler.pooling_cap() is None
    done = first.num_computed
    assert done < 10
    plan = scheduler.schedule()
    assert [(e.seq.seq_no, e.start, e.num_tokens) for e in plan.seqs] == [(21, done, 10 - done)]  # the rest at once


def test_a_pooling_share_outside_its_range_is_refused() -> None:
    pool = BlockPool(8, BLOCK_SIZE)
    sessions = SessionStore(pool, ttl_s=60.0, max_sessions=4, max_pool_fraction=1.0, clock=Clock())
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="pooling_share"):
            Scheduler(pool, sessions, max_num_seqs=4, max_num_batched_tokens=64, pooling_share=share)


@pytest.mark.parametrize(
    ("generating", "fixed", "share", "cap"),
    [(1, 0, 0.2, 1), (8, 0, 0.2, 2), (9, 0, 0.2, 2), (1, 63, 0.2, 16), (8, 63, 0.2, 17), (1, 63, 0.5, 64)],
)
def test_pooling_counts_the_steps_fixed_cost(generating: int, fixed: int, share: float, cap: int) -> None:
    """P(G) = max(1, floor((G + F) s / (1 - s))): a step's fixed cost F counted in tokens gives pooling its share
    of the step's whole cost, not only of its decodes (one token a step beside one stream, before F)."""
    pool = BlockPool(64, BLOCK_SIZE)
    sessions = SessionStore(pool, ttl_s=60.0, max_sessions=4, max_pool_fraction=1.0, clock=Clock())
    scheduler = Scheduler(
        pool, sessions, max_num_seqs=16, max_num_batched_tokens=256, pooling_share=share, pooling_step_tokens=fixed
    )
    for n in range(generating):
        scheduler.add(new_seq(n, [n, n + 1], max_new=30))
    scheduler.schedule()
    assert scheduler.pooling_cap() == cap
    with pytest.raises(ValueError, match="pooling_step_tokens"):
        Scheduler(pool, sessions, max_num_seqs=4, max_num_batched_tokens=64, pooling_step_tokens=-1)


def test_where_a_chunk_costs_its_step_m_pooling_saves_its_share_and_reads_in_chunks() -> None:
    """F 3, M 4, s 0.2 beside one stream: r = (1 + 3) 0.25 = 1 token a step, gathered as credit. Pooling reads
    nothing until the credit reaches M + POOLING_MIN_CHUNK = 20, then 16 tokens (the credit less M), and saves up
    again: each chunk pays its M once, the stream decodes every step, and a 40-token prompt is read at steps 20, 40
    and 60, within the stated ceil((40 (1 + 4 / 16) + 20) / 1) = 70 steps. Credit gathered with nothing to pool is
    held at one chunk's worth ahead, so a late request cannot take several chunks at once."""
    pool = BlockPool(64, BLOCK_SIZE)
    sessions = SessionStore(pool, ttl_s=60.0, max_sessions=4, max_pool_fraction=1.0, clock=Clock())
    scheduler = Scheduler(
        pool, sessions, max_num_seqs=16, max_num_batched_tokens=64, pooling_share=0.2, pooling_step_tokens=3
    )
    scheduler.pooling_chunk_tokens = 4
    assert POOLING_MIN_CHUNK == 16
    stream = new_seq(0, [1, 2], max_new=200)
    scheduler.add(stream)
    for ready in scheduler.update(scheduler.schedule()):
        ready.token_ids.append(3)
    for _ in range(50):  # nothing to pool: the credit stops at M + 16 + r = 21
        for ready in scheduler.update(scheduler.schedule()):
            ready.token_ids.append(3)
    assert scheduler.pooling_cap() == 17
    pooled = _pooling_seq(1, list(range(100, 140)))
    scheduler.add(pooled)
    read = []
    while pooled.num_computed < 40:
        plan = scheduler.schedule()
        assert stream.seq_no in {e.seq.seq_no for e in plan.seqs}  # the stream decodes every step
        read.append(sum(e.num_tokens for e in plan.seqs if e.seq.request.pooling is not None))
        for ready in scheduler.update(plan):
            if ready.request.pooling is None:
                ready.token_ids.append(3)
    assert read[0] == 17  # the one chunk saved ahead (21 - M)
    chunks = [(step, n) for step, n in enumerate(read, 1) if n]
    assert chunks == [(1, 17), (21, 16), (41, 7)], chunks
    assert len(read) <= 70
