"""Iteration-level scheduling: which sequences run in the next forward, and with how many tokens.

There is no separate prefill or decode phase: each sequence's computed-token count catches up with its token count,
at most `max_num_batched_tokens` tokens per step across the batch, so a long prompt is read in chunks while running
streams keep getting one token per step. Running sequences are served first, oldest first; when blocks run out, idle
sessions are evicted, then the newest running sequence is preempted (its blocks freed, recomputed later). Waiting
sequences are admitted by priority, then age, reusing session and prefix-cached blocks.

A sequence with `after` (completions 1..n-1 of an n > 1 request) stays in the queue, skipped without holding up
the others, until its completion 0 has computed the prompt (or finished); admitted then, it shares that prompt's
full blocks, copies the partial one (copy-on-write: completion 0 goes on writing there) and recomputes only the
prompt's last token, whose logits pick its own first token; so the n completions compute the prompt once. (After
completion 0 has finished, the prefix cache's full blocks are what is left to share, and the tail is recomputed.)

Speculative decoding (spec/): `schedule(drafts)` gives a decoding sequence its drafts as extra positions of its step
when they fit in the token budget and in blocks that are free now (a guess never preempts, evicts a session or a
cached prefix); `settle_drafts` keeps the books once the sampler has accepted some of them (sched/rollback.py's rule:
the KV of rejected drafts is dropped, their blocks freed, never hashed).

Overlap (--async-scheduling, core/steps.py): a step launched before the previous one's tokens are known is accounted
twice. `launched` right after the step is handed to the worker: its tokens count as computed and each sampling entry
leaves one token pending (`Sequence.num_pending`), so that the next schedule plans that sequence's next position with
a placeholder (plan.PENDING) while the step runs. `landed` once its results are in: the blocks it filled are hashed
and registered for prefix caching (only now: the tokens are known, and the KV is written), and the copy sources it
held are let go. A step whose forward failed is `abandon`ed instead: nothing it wrote is registered. Steps run in
launch order on one device stream or worker, so a block freed while a step is in flight is only written again by a
later step.

With KV tiers (`tiers`), a waiting sequence whose prefix continues in a lower tier past what the pool holds
gets blocks that load that KV back (`StepPlan.loads`); it pins the blocks it will reuse and stays in the queue,
skipped without holding up the others, until every load is reported (`load_done`). A failed load leaves its
block anonymous: those tokens are recomputed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import Protocol

from llmserve.engine.sched.block_pool import BlockContent, BlockHash, BlockPool, chain_hash
from llmserve.engine.sched.plan import SeqStep, StepPlan, step_of
from llmserve.engine.sched.rollback import settle
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.sched.sessions import SessionStore
from llmserve.engine.types.outputs import FinishReason
from llmserve.engine.types.pooling import PoolingMode

# The least a pooling chunk takes where a chunk costs its step M tokens more (Scheduler.pooling_cap): M is then at
# most M / 16 of what the chunk reads (~4 / 16 on an AVX2 CPU's exact GGUF path), and a step that carries one costs
# one stream ~M + 16 + F tokens' worth (~23 against a step's ~4 beside one stream: ~55 ms once every ~20 steps).
POOLING_MIN_CHUNK = 16


class TierLookup(Protocol):
    """What the scheduler asks of the KV tiers below the pool (kv_tiers/worker.KVTiers): does some tier hold this exact
    block (parent and tokens checked)?"""

    def has(self, block_hash: BlockHash, parent: BlockHash, tokens: Tokens[int]) -> bool: ...


@dataclass(slots=True)
class _Pending:
    """A waiting sequence's reloads: the blocks it holds a reference on, and those still loading."""

    pins: list[int]
    waiting_on: set[int] = field(default_factory=set)


class Scheduler:
    """Owns the waiting heap and the running list; asks the block pool and the session store."""

    def __init__(
        self,
        pool: BlockPool,
        sessions: SessionStore,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        tiers: TierLookup | None = None,
        max_loras: int = 0,
        whole_prompts: bool = False,
        pooling_share: float = 1.0,
        pooling_step_tokens: int = 0,
    ) -> None:
        """`whole_prompts`: a prompt is admitted only when all of it fits in the step's budget, never in chunks (an
        encoder's bidirectional attention needs every token of an input in one forward). `pooling_share`: the most
        of a step's cost that pooling requests may take while generating sequences run, and `pooling_step_tokens`
        a step's fixed cost counted in tokens (pooling_cap)."""
        if not 0.0 < pooling_share <= 1.0:
            raise ValueError(f"pooling_share must be in (0, 1], got {pooling_share}")
        if pooling_step_tokens < 0:
            raise ValueError(f"pooling_step_tokens must be >= 0, got {pooling_step_tokens}")
        self.pool = pool
        self.whole_prompts = whole_prompts
        self.pooling_share = pooling_share
        self.pooling_step_tokens = pooling_step_tokens
        # M: what a step pays, in tokens, for carrying a pooling chunk at all (0: nothing; then pooling takes its
        # tokens every step); above 0, pooling's credit gathers its share step by step and is spent in chunks of at
        # least POOLING_MIN_CHUNK tokens (pooling_cap). The engine core sets both from its start-up measurement.
        self.pooling_chunk_tokens = 0
        self._pooling_credit = 0.0
        self.sessions = sessions
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.max_loras = max_loras  # the most distinct LoRA adapters among the running sequences
        self.running: list[Sequence] = []
        self.live: dict[int, Sequence] = {}  # every sequence not yet finished, waiting or running, by seq_no
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._num_waiting = 0
        self.num_preemptions = 0
        # Counted once per request, at its first admission (for the metrics): requests with a session id
        # that found it cached or not, and requests without a cached session that reused prefix-cached KV.
        self.num_session_hits = 0
        self.num_session_misses = 0
        self.num_prefix_cache_hits = 0
        self.tiers = tiers if enable_prefix_caching else None
        self._pending: dict[int, _Pending] = {}  # seq_no -> its reloads
        self._loading: dict[BlockHash, int] = {}  # digest -> the block it is loading into
        self._load_content: dict[int, BlockContent] = {}  # loading block -> what it will hold
        self._load_waiters: dict[int, list[int]] = {}  # loading block -> seq_nos that wait for it
        self.num_tier_loads = 0  # admissions that started at least one load (for the metrics)

    def is_loading(self, seq: Sequence) -> bool:
        """Whether a waiting sequence still waits for blocks to load."""
        pending = self._pending.get(seq.seq_no)
        return pending is not None and bool(pending.waiting_on)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def has_work(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add(self, seq: Sequence) -> None:
        self.live[seq.seq_no] = seq
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (-seq.request.priority, seq.seq_no, seq))
        self._num_waiting += 1

    # -- one step --------------------------------------------------------------------------------

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> StepPlan:
        """The next step: running sequences first (oldest first), then waiting ones by priority and age.

        `drafts`: by seq_no, tokens to verify after a decoding sequence's last one (see the module docstring).
        The plan's block tables are the sequences' own lists: read them before the next schedule().
        """
        out = StepPlan()
        budget = self.max_num_batched_tokens
        rate = self._pooling_rate()
        pooling = cap = self._pooling_cap_at(rate)  # what pooling may still take of this step; None: the budget
        if self.enable_prefix_caching or len(self.sessions):
            self.sessions.expire()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            room = _room(seq, budget, pooling)
            if seq.ends_by_length or room == 0:  # its tokens in flight end it (overlap), or pooling's cap is spent
                i += 1
                continue
            guess = drafts.get(seq.seq_no, ()) if drafts and seq.request.pooling is None else ()
            if guess and not self._room_for_drafts(seq, len(guess), budget - (len(self.running) - i - 1)):
                guess = ()
            n = 1 + len(guess) if guess else min(seq.num_uncomputed, room)
            if not self._grow(seq, n, out):
                break  # seq itself was preempted: nothing newer is left
            out.seqs.append(step_of(seq, n, guess))
            budget -= n
            pooling = _spent(seq, pooling, n)
            i += 1

        parked = []  # KV loading, or one LoRA adapter too many (--max-loras): they keep their place, hold up no one
        adapters = {s.adapter_id for s in self.running} - {None}
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            _, _, seq = self._waiting[0]
            if seq.status is not SeqStatus.WAITING:
                heapq.heappop(self._waiting)  # aborted while waiting
                continue
            adapter = seq.adapter_id
            if adapter is not None and adapter not in adapters and len(adapters) >= self.max_loras:
                parked.append(heapq.heappop(self._waiting))
                continue
            room = _room(seq, budget, pooling)
            if room == 0:  # a pooling request, with pooling's cap spent: it keeps its place
                parked.append(heapq.heappop(self._waiting))
                continue
            n = self._admit(seq, room, out)
            if n < 0:
                parked.append(heapq.heappop(self._waiting))
                continue
            if n == 0:
                break
            pooling = _spent(seq, pooling, n)
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(step_of(seq, n))
            budget -= n
            if adapter is not None:
                adapters.add(adapter)
        for entry in parked:
            heapq.heappush(self._waiting, entry)
        self._pooling_step_taken(rate, cap, pooling)
        if self.pool.track_evictions:
            out.offloads = self.pool.take_evicted()
        return out

    def pooling_cap(self) -> int | None:
        """How many tokens pooling requests (prefill-only sequences: Embed or a classifier on a decoder model) may
        compute in the next step: None (the whole budget) unless generating sequences run and `pooling_share` s < 1.

        The cost model: a step of n tokens costs about F + n tokens' worth of compute, F = `pooling_step_tokens`
        being what a step costs whatever it computes (reading the weights, launching the layers), and a step that
        carries a pooling chunk costs M = `pooling_chunk_tokens` more (on the CPU it leaves the compiled step program
        for the fused forward's loop); the engine core measures both at start unless the config gives F (then M is
        0; core/pooling_cost.py). Pooling's share of a step beside G generating sequences is r = (G + F) s / (1 - s)
        tokens: spent on pooling, a step of G decodes then costs at most 1 / (1 - s) of the step alone, so the
        streams keep at least 1 - s of their tokens/s (0.8x at s = 0.2), however much embedding traffic waits (a
        prompt chunk among the G counts one: the bound errs on generation's side).

        With M = 0, pooling takes P(G) = max(1, floor(r)) tokens every step. With M > 0 it gathers r a step as
        credit and spends it when the credit reaches M + POOLING_MIN_CHUNK: floor(credit - M) tokens, then credit
        less M and the tokens taken (a chunk pays its step's M once, instead of every step).

        And pooling is never starved: while it has work, KV room and a free running slot, an Embed call whose inputs
        hold N tokens, behind W pooling tokens queued before it, is read within ceil((W + N) / P(G)) steps with M = 0,
        and within ceil(((W + N) (1 + M / Q) + M + Q) / r) steps with M > 0 (Q = POOLING_MIN_CHUNK: each chunk takes
        at least Q tokens for its M). Beside one stream: 320 steps for 256 inputs of 20 tokens at F = 63 (M 0), and
        at the exact GGUF path on an AVX2 CPU's measured F = 3, M = 4 (r = 1), 6,420 steps, about 80 s."""
        return self._pooling_cap_at(self._pooling_rate())

    def _pooling_cap_at(self, rate: float | None) -> int | None:
        """pooling_cap at pooling's share `rate` (_pooling_rate), which schedule() also reads for the credit."""
        if rate is None:
            return None
        chunk = self.pooling_chunk_tokens
        if not chunk:
            return max(1, math.floor(rate + 1e-9))
        credit = self._pooling_credit_with(rate)
        return math.floor(credit - chunk + 1e-9) if credit >= chunk + POOLING_MIN_CHUNK else 0

    def _pooling_rate(self) -> float | None:
        """r, pooling's share of the next step in tokens beside the generating sequences running (pooling_cap);
        None when pooling is uncapped."""
        if self.pooling_share >= 1.0 or self.whole_prompts:
            return None
        generating = sum(1 for seq in self.running if seq.request.pooling is None)
        if not generating:
            return None
        return (generating + self.pooling_step_tokens) * self.pooling_share / (1.0 - self.pooling_share)

    def _pooling_credit_with(self, rate: float) -> float:
        """Pooling's credit once this step's share is added: at most one chunk's worth ahead (it gathers while no
        pooling work spends it)."""
        return min(self._pooling_credit + rate, self.pooling_chunk_tokens + POOLING_MIN_CHUNK + rate)

    def _pooling_step_taken(self, rate: float | None, cap: int | None, left: int | None) -> None:
        """Pooling's credit after a step planned with `cap` (pooling_cap's, at `rate`), `left` of it unspent: the
        step's share added, and a chunk's tokens and its M taken out when the step carries one."""
        if rate is None or cap is None or left is None:
            self._pooling_credit = 0.0  # uncapped: nothing to save up for
            return
        if self.pooling_chunk_tokens:
            credit = self._pooling_credit_with(rate)
            taken = cap - left
            self._pooling_credit = credit - (self.pooling_chunk_tokens + taken if taken else 0)

    def load_done(self, block: int, ok: bool) -> None:
        """A load from `StepPlan.loads` is over; `ok`: the KV was written into the block and checked sound."""
        content = self._load_content.pop(block)
        del self._loading[content.block_hash]
        self.pool.end_load(block, content if ok else None)
        for seq_no in self._load_waiters.pop(block, []):
            pending = self._pending.get(seq_no)
            if pending is not None:
                pending.waiting_on.discard(block)

    def update(self, plan: StepPlan) -> list[Sequence]:
        """Account the computed tokens; returns the sequences that caught up and need a new token."""
        ready = []
        bs = self.pool.block_size
        for step in plan.seqs:
            seq = step.seq
            before = seq.num_computed
            seq.num_computed += len(step.token_ids) - len(step.drafts)  # drafts: settle_drafts
            if self.enable_prefix_caching and seq.num_computed // bs > before // bs:  # a block was filled
                self._register_full_blocks(seq, before)
            if seq.num_computed == len(seq.token_ids):
                ready.append(seq)
        # The copies are done: drop the references that kept their sources alive.
        self.pool.release(src for src, _ in plan.copies)
        return ready

    def abandon(self, out: StepPlan) -> None:
        """A step whose forward failed: nothing was computed, so no block is registered as holding a prefix
        (its KV may be unwritten or half-written); only the copy sources are let go."""
        self.pool.release(src for src, _ in out.copies)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence: its blocks go to its session (if any, and the KV is sound) or back to the pool."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is dropped lazily
            pending = self._pending.pop(seq.seq_no, None)
            if pending is not None:  # aborted while loading: the loads run on, holding their own references
                self.pool.release(pending.pins)
        else:
            self.running.remove(seq)
        del self.live[seq.seq_no]
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        session_id = seq.request.session_id
        if session_id is not None and reason is not FinishReason.ERROR and seq.num_computed > 0:
            keep = self.pool.blocks_for(seq.num_computed)
            self.pool.release(seq.block_table[keep:])
            self.sessions.retain(session_id, seq.token_ids[: seq.num_computed], seq.block_table[:keep], seq.prefix_root)
        else:
            self.pool.release(seq.block_table)
        seq.block_table = []

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and put it back at the head of its priority class."""
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = seq.num_pending = 0  # pending: what steps in flight sample for it is dropped (overlap)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # -- drafts (speculative decoding) -------------------------------------------------------------

    def settle_drafts(self, step: SeqStep, kept: int) -> None:
        """After `update`: `kept` of the step's drafts were accepted and appended to the sequence's tokens. Counts
        them computed, registers the blocks they filled and frees the blocks past what the sequence now needs."""
        seq = step.seq
        bs = self.pool.block_size
        settled = settle(step.block_table, step.start, len(step.drafts), kept, bs)
        before = seq.num_computed
        seq.num_computed = settled.num_computed
        if self.enable_prefix_caching and seq.num_computed // bs > before // bs:
            self._register_full_blocks(seq, before)
        if settled.freed:
            self.pool.release(settled.freed)
            # A new list, not one cut in place: a backend's input batch keeps each row's table by identity and
            # rewrites it only when the list is another (a table cut in place and grown again would look unchanged).
            seq.block_table = seq.block_table[: settled.keep]

    def waiting_tokens(self, limit: int) -> int:
        """The prompt tokens that waiting sequences would compute, counted up to `limit` (what admission may take
        of the next step's budget)."""
        total = 0
        for _, _, seq in self._waiting:
            if seq.status is SeqStatus.WAITING:
                total += seq.num_uncomputed
                if total >= limit:
                    return limit
        return total

    def _room_for_drafts(self, seq: Sequence, k: int, budget: int) -> bool:
        """Whether a decoding seq can verify k drafts: within `budget` and blocks free now (no eviction)."""
        if seq.num_uncomputed != 1 or 1 + k > budget:
            return False
        need = self.pool.blocks_for(seq.num_computed + 1 + k) - len(seq.block_table)
        return need <= self.pool.num_free - self.pool.num_cached

    # -- steps launched ahead (overlap) ------------------------------------------------------------

    def launched(self, plan: StepPlan) -> None:
        """The plan's step is on its way: count its tokens computed and one token pending per sampling entry."""
        for step in plan.seqs:
            if step.drafts:
                raise ValueError("a step with drafts is not launched ahead (overlap is off for speculative steps)")
            seq = step.seq
            seq.num_computed += len(step.token_ids)
            if step.sample is not None:
                seq.num_pending += 1

    def landed(self, plan: StepPlan, live: Iterable[SeqStep]) -> None:
        """The plan's step is done and its tokens appended: register the blocks that the `live` entries (those
        still running, not preempted since) filled; let the copy sources go."""
        if self.enable_prefix_caching:
            bs = self.pool.block_size
            for step in live:
                if step.end // bs > step.start // bs:
                    self._register_full_blocks(step.seq, step.start, step.end)
        self.pool.release(src for src, _ in plan.copies)

    # -- helpers ---------------------------------------------------------------------------------

    def _grow(self, seq: Sequence, n: int, out: StepPlan) -> bool:
        """Give a running seq blocks for n more tokens, evicting sessions then preempting the newest."""
        need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need <= 0:
            return True  # most decode steps: the last block has room
        while not self.pool.can_allocate(need):
            if self.sessions.evict_one():
                continue
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _admit(self, seq: Sequence, budget: int, out: StepPlan) -> int:
        """Reuse cached KV for a waiting seq and give it blocks for its first chunk; 0 if it must wait, -1 if its
        KV is loading from a lower tier or its completion 0 has not computed the prompt yet (it waits, the next one
        may go)."""
        after = seq.after
        if after is not None and after.status is not SeqStatus.FINISHED and after.num_computed < after.num_prompt:
            return -1
        pending = self._pending.pop(seq.seq_no, None)
        if pending is not None and pending.waiting_on:
            self._pending[seq.seq_no] = pending
            return -1
        if pending is None and self.tiers is not None and reads_cache(seq) and self._start_loads(seq, out, self.tiers):
            return -1
        tokens = seq.token_ids
        session_id = seq.request.session_id
        had_session = session_id is not None and session_id in self.sessions
        reused, shared, cow_src = self._find_reuse(seq)
        # Hold the blocks to reuse (and the copy source) before anything can be evicted; then the pins of the
        # reloads can go (whatever of them is reused is held again).
        held = shared + ([cow_src] if cow_src is not None else [])
        self.pool.acquire(held)
        if pending is not None:
            self.pool.release(pending.pins)
        n = min(len(tokens) - reused, budget)
        if self.whole_prompts and n < len(tokens) - reused:
            self.pool.release(held)
            return 0
        need = self.pool.blocks_for(reused + n) - len(shared)
        if not self.pool.can_allocate(need) and not self.sessions.evict_until_free(need):
            self.pool.release(held)
            return 0
        fresh = self.pool.allocate(need)
        if cow_src is not None:
            out.copies.append((cow_src, fresh[0]))
        seq.block_table = shared + fresh
        seq.num_computed = reused
        if seq.num_preemptions == 0:
            seq.num_cached_prompt = reused
            if session_id is not None:
                self.num_session_hits += had_session
                self.num_session_misses += not had_session
            if reused and not had_session:
                self.num_prefix_cache_hits += 1
        return n

    def _find_reuse(self, seq: Sequence) -> tuple[int, list[int], int | None]:
        """(tokens whose KV can be reused, full blocks to share, block to copy for a partial last block).

        At least one token is always left to compute, since its logits pick the next token.
        """
        tokens = seq.token_ids
        bs = self.pool.block_size
        limit = len(tokens) - 1
        shared: list[int] = []
        if not reads_cache(seq):
            return 0, [], None
        if self.enable_prefix_caching:
            self._hash_blocks(seq, limit // bs)
            parent = seq.prefix_root
            for i, block_hash in enumerate(seq.block_hashes[: limit // bs]):
                block = self.pool.lookup(block_hash, parent, tokens[i * bs : (i + 1) * bs])
                if block is None:
                    break
                shared.append(block)
                parent = block_hash
        after = seq.after
        if after is not None and after.status is SeqStatus.RUNNING:
            # Completion 0's KV of the prompt, all but its last token (recomputed here: its logits pick this
            # completion's first token): its full blocks shared, and the block that holds the rest copied, since
            # completion 0 goes on writing its generated tokens there (copy-on-write).
            ready = min(after.num_computed, limit, seq.num_prompt)
            if ready > len(shared) * bs:
                full = ready // bs
                cow = after.block_table[full] if ready % bs else None
                return ready, after.block_table[:full], cow
        session_id = seq.request.session_id
        if session_id is not None:
            matched, blocks = self.sessions.match(session_id, tokens, seq.prefix_root)
            matched = min(matched, limit)
            if matched > len(shared) * bs:
                full = matched // bs
                cow = blocks[full] if matched % bs else None
                return matched, blocks[:full], cow
        return len(shared) * bs, shared, None

    def _start_loads(self, seq: Sequence, out: StepPlan, tiers: TierLookup) -> bool:
        """Start loading the blocks of seq's prefix that a lower tier holds past the pool's; True if it must wait.

        Loads start only where they extend the reuse past what the pool or the seq's session holds, and only into
        blocks that are free now (after evicting idle sessions); otherwise the seq recomputes."""
        tokens = seq.token_ids
        bs = self.pool.block_size
        num_full = (len(tokens) - 1) // bs
        self._hash_blocks(seq, num_full)
        hashes = seq.block_hashes
        parent = seq.prefix_root
        pins: list[int] = []
        waits: list[int] = []
        loads: list[BlockContent] = []
        i = 0
        # Block by block: the pool, else a load already running, else a tier. The pool may have kept the later
        # blocks of a prefix whose first ones it evicted.
        while i < num_full:
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            block = self.pool.lookup(hashes[i], parent, block_tokens)
            loading = self._loading.get(hashes[i])
            if block is not None:
                pins.append(block)
            elif loading is not None and self._load_content[loading] == BlockContent(hashes[i], parent, block_tokens):
                waits.append(loading)
            elif loading is None and tiers.has(hashes[i], parent, block_tokens):
                loads.append(BlockContent(hashes[i], parent, block_tokens))
            else:
                break
            parent = hashes[i]
            i += 1
        if not waits and not loads:
            return False
        session_id = seq.request.session_id
        if session_id is not None and self.sessions.covered(session_id, tokens, seq.prefix_root) >= i * bs:
            return False  # the session in the pool covers as much: no load needed
        self.pool.acquire(pins + waits)  # before anything is evicted for the new blocks
        if not self.pool.can_allocate(len(loads)) and not self.sessions.evict_until_free(len(loads)):
            self.pool.release(pins + waits)
            return False
        blocks = self.pool.begin_load(len(loads))
        self.pool.acquire(blocks)  # the seq's own reference, beside the load's
        for block, content in zip(blocks, loads, strict=True):
            self._loading[content.block_hash] = block
            self._load_content[block] = content
            out.loads.append((block, content))
        for block in waits + blocks:
            self._load_waiters.setdefault(block, []).append(seq.seq_no)
        self._pending[seq.seq_no] = _Pending(pins + waits + blocks, set(waits + blocks))
        self.num_tier_loads += 1
        return True

    def _hash_blocks(self, seq: Sequence, num_full: int) -> None:
        bs = self.pool.block_size
        hashes = seq.block_hashes
        # The salt is the root of the chain, so every block inherits it through its parents.
        root = seq.prefix_root if len(hashes) < num_full else b""
        while len(hashes) < num_full:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else root, seq.token_ids[i * bs : (i + 1) * bs]))

    def _register_full_blocks(self, seq: Sequence, computed_before: int, upto: int | None = None) -> None:
        bs = self.pool.block_size
        num_full = (seq.num_computed if upto is None else upto) // bs
        self._hash_blocks(seq, num_full)
        for i in range(computed_before // bs, num_full):
            if self.pool.block_hash[seq.block_table[i]] is None:
                parent = seq.block_hashes[i - 1] if i else seq.prefix_root
                tokens = seq.token_ids[i * bs : (i + 1) * bs]
                self.pool.register(seq.block_table[i], seq.block_hashes[i], parent, tokens, seq.request.cache_salt)


def reads_cache(seq: Sequence) -> bool:
    """Whether a waiting sequence may start from cached KV (the prefix cache, its session, a lower tier, its completion
    0's). Not when it needs what cached blocks do not hold (only K and V are kept): mean, max and CLS pooling read
    every position's (or the first's) hidden state, and prompt logprobs every position's logits, so those recompute
    the whole prompt (vLLM recomputes prompt logprobs likewise); what they compute still enters the prefix cache
    (`_register_full_blocks`). Last-token pooling reads only the last position, which is always computed: it reuses
    cached blocks as generation does."""
    pooling = seq.request.pooling
    if pooling is not None and pooling.mode is not PoolingMode.LAST:
        return False
    return not seq.scores_prompt


def _room(seq: Sequence, budget: int, pooling: int | None) -> int:
    """The most tokens `seq` may compute in the step: what is left of the budget, and for a pooling request no
    more than pooling's cap leaves (`pooling`: None when uncapped)."""
    return budget if pooling is None or seq.request.pooling is None else min(budget, pooling)


def _spent(seq: Sequence, pooling: int | None, n: int) -> int | None:
    """Pooling's cap once `seq` computes `n` tokens in the step."""
    return pooling if pooling is None or seq.request.pooling is None else pooling - n
