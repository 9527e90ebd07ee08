"""The scheduler's books for steps launched ahead (sched/scheduler.py's launched/landed), over integers: placeholders
for the tokens in flight, no step past a length they reach, prefix blocks registered only once their step has landed,
and the same blocks and outputs as plain steps when each step lands one step late."""

from __future__ import annotations

from llmserve.engine.sched.block_pool import BlockPool
from llmserve.engine.sched.plan import PENDING, StepPlan
from llmserve.engine.sched.scheduler import Scheduler
from llmserve.engine.sched.sequence import SeqStatus, Sequence
from llmserve.engine.sched.sessions import SessionStore
from llmserve.engine.types.outputs import FinishReason
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from tests.engine.engine_helpers import clear_cache

BS = 4


def _books(num_blocks: int = 16, budget: int = 8) -> Scheduler:
    pool = BlockPool(num_blocks, BS)
    return Scheduler(pool, SessionStore(pool, ttl_s=60, max_sessions=4, max_pool_fraction=1.0), max_num_seqs=4,
                     max_num_batched_tokens=budget)  # fmt: skip


def _seq(n: int, prompt: list[int], max_new: int) -> Sequence:
    request = GenerationRequest(f"r{n}", tuple(prompt), stopping=StoppingParams(max_new_tokens=max_new))
    seq = Sequence(request, list(prompt), float(n), n)
    seq.length_limit = len(prompt) + max_new
    return seq


def _token(seq: Sequence, position: int) -> int:
    return 100 + 7 * seq.seq_no + position  # what the "model" samples at a position: known to the test alone


def test_the_next_step_computes_the_token_in_flight_as_a_placeholder() -> None:
    books = _books()
    seq = _seq(1, [1, 2, 3, 4, 5, 6], max_new=3)
    books.add(seq)
    first = books.schedule()
    assert [list(e.token_ids) for e in first.seqs] == [[1, 2, 3, 4, 5, 6]]
    books.launched(first)
    assert seq.num_computed == 6 and seq.num_pending == 1 and seq.num_uncomputed == 1
    second = books.schedule()
    (entry,) = second.seqs
    assert entry.start == 6 and list(entry.token_ids) == [PENDING] and entry.sample is not None
    books.launched(second)
    # The first step lands: its token appended; the block it filled (positions 0-3) registered only now.
    assert books.pool.num_cached == 0
    seq.num_pending -= 1
    seq.token_ids.append(_token(seq, 6))
    books.landed(first, first.seqs)
    assert books.pool.block_hash[seq.block_table[0]] is not None
    assert books.pool.block_hash[seq.block_table[1]] is None  # positions 4-7: not all computed yet
    # Two tokens generated (one landed, one in flight), a third would end it: one more step, then none.
    third = books.schedule()
    assert [e.start for e in third.seqs] == [7]
    books.launched(third)
    assert seq.ends_by_length and books.schedule().seqs == []


def test_a_preempted_sequence_drops_its_tokens_in_flight() -> None:
    books = _books(num_blocks=3, budget=8)
    old, new = _seq(1, [1, 2, 3], max_new=8), _seq(2, [4, 5, 6], max_new=8)
    books.add(old)
    books.add(new)
    plan = books.schedule()
    books.launched(plan)
    assert old.num_pending == new.num_pending == 1
    # Both grow into a second block at position 4: three blocks do not hold two sequences' four: the newest goes.
    for seq in (old, new):
        seq.num_pending -= 1
        seq.token_ids.append(_token(seq, 3))
    books.landed(plan, plan.seqs)
    plan = books.schedule()
    books.launched(plan)
    nxt = books.schedule()
    assert new in nxt.preempted and new.status is SeqStatus.WAITING
    assert new.num_pending == 0 and new.num_computed == 0 and new.num_uncomputed == 4


def test_launching_ahead_ends_with_the_same_books_as_plain_steps() -> None:
    """Several sequences, each step landing one step late: the same tokens, every block back, none leaked."""

    def serve(ahead: bool) -> tuple[dict[int, list[int]], int]:
        books = _books(num_blocks=12, budget=6)
        seqs = [_seq(i, list(range(1 + i, 6 + 2 * i)), max_new=5 + i) for i in range(4)]
        for seq in seqs:
            books.add(seq)
        flight: StepPlan | None = None
        for _ in range(200):
            if not books.has_work and flight is None:
                break
            plan = books.schedule()
            if ahead:
                books.launched(plan)
                if flight is not None:
                    _land(books, flight)
                flight = plan if plan.seqs else None
            else:
                for seq in books.update(plan):
                    seq.token_ids.append(_token(seq, len(seq.token_ids)))
                    if len(seq.token_ids) >= seq.length_limit:
                        books.finish(seq, FinishReason.LENGTH)
        assert all(seq.status is SeqStatus.FINISHED for seq in seqs)
        cached = books.pool.num_cached
        clear_cache(books.pool)
        assert books.pool.num_free == books.pool.num_blocks
        return {seq.seq_no: seq.token_ids for seq in seqs}, cached

    assert serve(ahead=True) == serve(ahead=False)


def _land(books: Scheduler, plan: StepPlan) -> None:
    for entry in plan.sampling:
        seq = entry.seq
        if seq.status is SeqStatus.FINISHED:
            continue
        seq.num_pending -= 1
        seq.token_ids.append(_token(seq, len(seq.token_ids)))
        if len(seq.token_ids) >= seq.length_limit:
            seq.num_computed = min(seq.num_computed, len(seq.token_ids) - 1)
            books.finish(seq, FinishReason.LENGTH)
    books.landed(plan, [e for e in plan.seqs if e.seq.status is not SeqStatus.FINISHED])
