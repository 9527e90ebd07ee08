"""The step's drafts: which decoding sequences verify guesses this step, and which guesses.

One object per engine core (`--speculative ngram|suffix|off`), asked once per step before the schedule. It keeps
the proposer's per-sequence state, each sequence's measured acceptance (policy.Acceptance) and the load rule
(policy.Policy over the step-cost table measured at start-up, calibrate.py). When the rule says drafts cannot pay at
this step's batch size, even for the most accepted sequence, no proposer is asked (a step at high load costs one
call). A constrained sequence drafts the tokens its grammar forces, then as much of the proposer's guess as the
grammar allows (forced.py). Drafts are cut so that no position is computed that could never be sent: the context
limit, and max_new_tokens (a sequence with r tokens left verifies at most r - 1 drafts).

The counters (`stats`) are what the metrics export: steps that verified drafts, drafts proposed (verified),
accepted, and tokens emitted by the verifying sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

from llmserve.engine.sched.sequence import Sequence as Seq
from llmserve.engine.spec.forced import grammar_drafts
from llmserve.engine.spec.policy import Acceptance, Candidate, CostTable, Policy
from llmserve.engine.types.stats import SpecStats

METHODS = ("off", "ngram", "suffix")


class Proposer(Protocol):
    def propose(self, key: int, tokens: Sequence[int], k: int | None = None) -> list[int]: ...


class Drafter:
    """Drafts per step for `method` ("ngram" or "suffix"), chosen by `policy`; see the module docstring."""

    def __init__(self, method: str, max_k: int, max_model_len: int, cost: CostTable | None = None) -> None:
        if method not in METHODS[1:]:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS[1:])}, got {method!r}")
        self.method = method
        self.max_k = max_k
        self.policy: Policy | None = None  # off until the step cost is known (set_cost)
        self.cost: CostTable | None = None
        if cost is not None:
            self.set_cost(cost)
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self.forced_k: int | None = None  # calibration: every decoding sequence verifies this many drafts
        self._acceptance: dict[int, Acceptance] = {}
        self._started: set[int] = set()
        self.proposer: Proposer
        if method == "suffix":
            from llmserve.engine.spec.suffix import SuffixProposer

            self._suffix: SuffixProposer | None = SuffixProposer()
            self.proposer = self._suffix
        else:
            from llmserve.engine.spec.ngram import NgramProposer

            self._suffix = None
            self._ngram = NgramProposer()
            self.proposer = self._ngram

    def snapshot(self) -> SpecStats:
        """A copy of the counters (any thread; the step thread goes on counting)."""
        return dataclasses.replace(self.stats, k_counts=self.stats.k_counts.copy())

    def set_cost(self, cost: CostTable) -> None:
        self.cost = cost
        self.policy = Policy(cost, max_k=self.max_k)

    def drafts(self, running: Iterable[Seq], budget: int) -> dict[int, list[int]]:
        """By seq_no, the drafts the decoding sequences of `running` verify this step, `budget` draft tokens at
        most in all (what the step's token budget leaves after every sequence's own token and admissions)."""
        decoding = [seq for seq in running if seq.num_uncomputed == 1]
        if not decoding or budget <= 0:
            return {}
        if self.forced_k is not None:  # calibration: any tokens will do (the cost does not depend on them)
            forced = self.forced_k
            return {s.seq_no: [s.token_ids[-1]] * k for s in decoding if (k := min(forced, self._room(s))) > 0}
        policy = self.policy
        if policy is None:  # the step cost is not measured yet (the warm-up's own steps): no choice of the rule's
            return {}
        if not policy.worthwhile(len(decoding), max(self._rate(seq) for seq in decoding)):
            self.stats.off_steps += 1
            return {}
        offers = [self._offer(seq, min(self.max_k, self._room(seq))) for seq in decoding]
        candidates = [Candidate(len(offer), self._rate(seq)) for seq, offer in zip(decoding, offers, strict=True)]
        chosen = policy.choose(candidates, budget)
        out = {seq.seq_no: offer[:k] for seq, offer, k in zip(decoding, offers, chosen, strict=True) if k > 0}
        if not out:
            self.stats.off_steps += 1
        return out

    def observe(self, seq_no: int, proposed: int, accepted: int, emitted: int) -> None:
        """A sequence verified `proposed` drafts, `accepted` of them were accepted, `emitted` tokens were kept."""
        if self.forced_k is not None:
            return
        acceptance = self._acceptance.get(seq_no)
        if acceptance is not None:
            acceptance.update(proposed, accepted)
        stats = self.stats
        stats.proposed += proposed
        stats.accepted += accepted
        stats.emitted += emitted
        stats.verifying += 1
        stats.k_counts[proposed] = stats.k_counts.get(proposed, 0) + 1

    def step_verified(self) -> None:
        if self.forced_k is None:
            self.stats.steps += 1

    def release(self, seq: Seq) -> None:
        """A sequence finished: its answer (the tokens it was sent) stays in its identity's suffix tree."""
        key = seq.seq_no
        self._acceptance.pop(key, None)
        if key in self._started:
            self._started.discard(key)
            if self._suffix is not None:
                self._suffix.release(key, seq.token_ids)
            else:
                self._ngram.release(key)

    # -- internals ---------------------------------------------------------------------------------

    def _rate(self, seq: Seq) -> float:
        acceptance = self._acceptance.get(seq.seq_no)
        if acceptance is None:
            acceptance = self._acceptance[seq.seq_no] = Acceptance()
        return acceptance.rate

    def _room(self, seq: Seq) -> int:
        """The most drafts whose every position could be sent: within max_new_tokens and the context."""
        left = seq.request.stopping.max_new_tokens - seq.num_generated
        return max(0, min(left - 1, self.max_model_len - len(seq.token_ids)))

    def _offer(self, seq: Seq, k: int) -> list[int]:
        if k <= 0:
            return []
        key = seq.seq_no
        if key not in self._started:
            self._started.add(key)
            if self._suffix is not None:
                self._suffix.start(key, seq.request.cache_salt, seq.token_ids[: seq.num_prompt])
        constraint = seq.constraint
        if constraint is not None:
            if constraint.done:
                return []
            guess = self.proposer.propose(key, seq.token_ids, k)
            drafts, _ = grammar_drafts(constraint.matcher, k, guess)
            return drafts
        return self.proposer.propose(key, seq.token_ids, k)
