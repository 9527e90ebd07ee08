"""The KV books of verification steps: a hypothesis state machine over the real BlockPool.

Sequences are admitted (reusing prefix-cached blocks), take verification steps with drafts of which some are accepted,
and finish. The machine keeps what each cache slot was last written with, and after every rule checks the pool's
ref counts against the sequences' tables, that a running sequence's table is exactly as long as its computed tokens
need, that every position it counts as computed holds the KV of its own token there, and that every block the prefix
cache holds has the KV of the tokens its hash names: a rejected draft's KV is never counted or cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmserve.engine.sched.block_pool import BlockPool, chain_hash
from llmserve.engine.sched.rollback import settle
from llmserve.engine.types.kv_cache import blocks_for
from tests.engine.sched.pool_checks import check_pool

BS = 4
VOCAB = 5  # few tokens: prompts share prefixes and drafts collide with the truth often


@dataclass
class Seq:
    tokens: list[int]
    table: list[int]
    num_computed: int
    hashes: list[bytes] = field(default_factory=list)  # the chain hashes of its full computed blocks


class VerifyBooks(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(24, BS)
        self.seqs: list[Seq] = []
        self.kv: dict[int, int] = {}  # slot -> the token whose KV was last written there

    def _write(self, seq: Seq, start: int, tokens: list[int]) -> None:
        for i, token in enumerate(tokens):
            p = start + i
            self.kv[seq.table[p // BS] * BS + p % BS] = token

    def _register(self, seq: Seq) -> None:
        """Scheduler.update's rule: each block that num_computed now covers gets its chain hash."""
        for b in range(len(seq.hashes), seq.num_computed // BS):
            parent = seq.hashes[-1] if seq.hashes else None
            block_tokens = seq.tokens[b * BS : (b + 1) * BS]
            digest = chain_hash(parent, block_tokens)
            self.pool.register(seq.table[b], digest, parent, block_tokens)
            seq.hashes.append(digest)

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14), first=st.integers(0, VOCAB - 1))
    def admit(self, prompt: list[int], first: int) -> None:
        """Reuse the prompt's cached full blocks (all but its last token), compute the rest, sample a first token."""
        shared: list[int] = []
        parent = None
        for b in range((len(prompt) - 1) // BS):
            block_tokens = prompt[b * BS : (b + 1) * BS]
            digest = chain_hash(parent, block_tokens)
            block = self.pool.lookup(digest, parent, block_tokens)
            if block is None:
                break
            shared.append(block)
            parent = digest
        need = blocks_for(len(prompt), BS) - len(shared)
        if not self.pool.can_allocate(need):
            return
        self.pool.acquire(shared)
        seq = Seq(list(prompt), shared + self.pool.allocate(need), len(prompt))
        reused = len(shared) * BS
        self._write(seq, reused, prompt[reused:])
        self._register(seq)
        seq.tokens.append(first)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(
        data=st.data(),
        drafts=st.lists(st.integers(0, VOCAB - 1), max_size=7),
        truth=st.lists(st.integers(0, VOCAB - 1), min_size=8, max_size=8),
    )
    def verify_step(self, data: st.DataObject, drafts: list[int], truth: list[int]) -> None:
        """Compute the last token and the drafts; the sampler's picks are `truth`: accept the matching prefix."""
        seq = data.draw(st.sampled_from(self.seqs))
        start = seq.num_computed
        need = blocks_for(start + 1 + len(drafts), BS) - len(seq.table)
        if not self.pool.can_allocate(need):
            return
        seq.table.extend(self.pool.allocate(need))
        self._write(seq, start, [seq.tokens[-1], *drafts])
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
            accepted += 1
        books = settle(seq.table, start, len(drafts), accepted, BS)
        self.pool.release(books.freed)
        del seq.table[books.keep :]
        seq.num_computed = books.num_computed
        seq.tokens.extend(truth[: accepted + 1])  # the accepted drafts, then the correction or the bonus token
        self._register(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.pool.release(seq.table)

    @invariant()
    def books_are_exact(self) -> None:
        check_pool(self.pool, [seq.table for seq in self.seqs])
        for seq in self.seqs:
            assert len(seq.table) == blocks_for(seq.num_computed, BS)
            assert seq.num_computed == len(seq.tokens) - 1  # only the last (sampled) token is uncomputed
            for p in range(seq.num_computed):
                assert self.kv[seq.table[p // BS] * BS + p % BS] == seq.tokens[p]

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        for block in range(self.pool.num_blocks):
            content = self.pool.content(block)
            if content is not None:
                assert [self.kv.get(block * BS + i) for i in range(BS)] == list(content.tokens)


TestVerifyBooks = VerifyBooks.TestCase
TestVerifyBooks.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_settle_keeps_the_accepted_positions_and_frees_the_tail() -> None:
    # Last token at 6, drafts at 7..13 in blocks of 4: the table was grown to 4 blocks (positions 0..15).
    books = settle([10, 11, 12, 13], start=6, num_drafts=7, accepted=2, block_size=4)
    assert (books.num_computed, books.keep, books.freed, books.stale) == (9, 3, [13], range(9, 12))
    everything = settle([10, 11, 12, 13], start=6, num_drafts=7, accepted=7, block_size=4)
    assert (everything.num_computed, everything.keep, everything.freed, everything.stale) == (14, 4, [], range(14, 14))
    nothing = settle([10, 11, 12, 13], start=6, num_drafts=7, accepted=0, block_size=4)
    assert (nothing.num_computed, nothing.keep, nothing.freed) == (7, 2, [12, 13])


def test_settle_refuses_counts_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"accepted must be in \[0, 2\], got 3"):
        settle([1, 2], 3, 2, 3, 4)
    with pytest.raises(ValueError, match="a table of 1 blocks cannot hold positions up to 6"):
        settle([1], 3, 2, 0, 4)
    with pytest.raises(ValueError, match="start must be >= 0, got -1"):
        settle([1], -1, 0, 0, 4)
