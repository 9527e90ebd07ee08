"""The load rule: how many drafts each sequence verifies this step, so that speculation never costs.

Verifying k drafts makes a sequence's share of the forward k + 1 query tokens; it pays when the tokens it is expected
to add outweigh the time they add. Both sides are measured: the step's time by batch size and drafts per sequence
(`CostTable`, from the phase-1 probe spec_verify_cost.py, or timed by the engine at start-up), each
request's acceptance as it goes (`Acceptance`). On this project's CPU a step of 32 sequences with one draft each
takes 3x the step without (the draft positions leave the compiled decode kernel for the chunk path), while a single
sequence verifies 8 drafts for 1.26x: the rule speculates at low load and turns itself off as the batch grows.

The model: a request whose drafts are each accepted with probability `a` (given the one before was) emits
1 + a + a^2 + ... + a^k tokens in a step with k drafts. The step's output rate is (sequences + expected extra
tokens) / (the step's time without drafts + what the drafts add), and `choose` picks, over the sequences with
drafts, the most confident first, how many of them verify (S) and up to how many drafts each (K), the pair with the
highest rate; it keeps it only if that beats the rate without drafts by `min_gain`, and never exceeds the step's
token budget. A prompt chunk in the step is a fixed cost either way, so the rule compares decode rates only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True, frozen=True)
class CostTable:
    """Measured step times in ms: `ms[i][j]` for `batches[i]` sequences each verifying `ks[j]` drafts (ks[0] == 0:
    plain decode). Read in between by linear interpolation; past the largest batch, per sequence as there."""

    batches: tuple[int, ...]
    ks: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.batches or list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ValueError("batches must be increasing and >= 1")
        if not self.ks or self.ks[0] != 0 or list(self.ks) != sorted(set(self.ks)):
            raise ValueError("ks must be increasing and start at 0")
        if len(self.ms) != len(self.batches) or any(len(row) != len(self.ks) for row in self.ms):
            raise ValueError("ms must have a row per batch and a column per k")

    def step_ms(self, batch: float, k: float) -> float:
        """The time of a step of `batch` sequences each verifying `k` drafts (both may be fractional)."""
        if batch <= 0:
            return 0.0
        top = self.batches[-1]
        if batch > top:  # beyond the table: as many times the largest batch's step per sequence
            return self.step_ms(top, k) * batch / top
        i = _segment(self.batches, batch)
        b0, b1 = self.batches[i], self.batches[min(i + 1, len(self.batches) - 1)]
        lo, hi = self._row_ms(i, k), self._row_ms(min(i + 1, len(self.batches) - 1), k)
        return lo if b1 == b0 else lo + (hi - lo) * (batch - b0) / (b1 - b0)

    def _row_ms(self, i: int, k: float) -> float:
        return _along(self.ks, self.ms[i], k)

    def row(self, batch: float) -> list[float]:
        """step_ms(batch, k) at every measured k: one batch size's row, to read at many k's."""
        return [self.step_ms(batch, k) for k in self.ks]

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, float]]) -> CostTable:
        """From the probe's JSON rows ({"batch", "k", "forward_ms"} each, every (batch, k) pair once)."""
        batches = tuple(sorted({int(r["batch"]) for r in rows}))
        ks = tuple(sorted({int(r["k"]) for r in rows}))
        at = {(int(r["batch"]), int(r["k"])): float(r["forward_ms"]) for r in rows}
        return cls(batches, ks, tuple(tuple(at[(b, k)] for k in ks) for b in batches))


def _along(ks: Sequence[int], row: Sequence[float], k: float) -> float:
    """The row's value at k, linear between the measured ks; past the last, the last (more drafts than measured
    count as the most measured: the policy never gives more than `max_k`, which the table should cover)."""
    k = min(max(k, 0.0), float(ks[-1]))
    j = _segment(ks, k)
    if j + 1 >= len(ks):
        return row[-1]
    return row[j] + (row[j + 1] - row[j]) * (k - ks[j]) / (ks[j + 1] - ks[j])


def _segment(points: Sequence[int], x: float) -> int:
    """The index i with points[i] <= x < points[i + 1] (clamped to the ends)."""
    return max(0, min(bisect.bisect_right(points, x) - 1, len(points) - 1))


@dataclass(slots=True)
class Acceptance:
    """One request's measured chance that a draft is accepted given the one before was: accepted drafts over the
    drafts that were tested (each step tests its accepted drafts and the first rejected one), counts decayed by
    `decay` per step so that it follows the request as it goes, from a prior of `prior` over `weight` drafts.
    A request that gets no drafts drifts back to the prior, so that one bad stretch does not end its speculation."""

    prior: float = 0.5
    weight: float = 2.0
    decay: float = 0.9
    accepted: float = field(init=False)
    tested: float = field(init=False)

    def __post_init__(self) -> None:
        self.accepted = self.prior * self.weight
        self.tested = self.weight

    @property
    def rate(self) -> float:
        return self.accepted / self.tested

    def update(self, proposed: int, accepted: int) -> None:
        """A step verified `proposed` drafts and accepted the first `accepted` (0 drafts: no evidence)."""
        self.accepted = self.prior * self.weight + (self.accepted - self.prior * self.weight) * self.decay
        self.tested = self.weight + (self.tested - self.weight) * self.decay
        if proposed > 0:
            self.accepted += accepted
            self.tested += accepted + (1 if accepted < proposed else 0)


@dataclass(slots=True, frozen=True)
class Candidate:
    """A decoding sequence this step: how many drafts its proposer offers, and its acceptance rate."""

    offered: int
    rate: float


def expected_extra(rate: float, k: int) -> float:
    """Tokens beyond the first that a sequence with k drafts emits, on average: a + a^2 + ... + a^k."""
    total, term = 0.0, 1.0
    for _ in range(k):
        term *= rate
        total += term
    return total


@dataclass(slots=True, frozen=True)
class Policy:
    """Chooses drafts per sequence per step from `cost`, keeping speculation only where it raises the step's output
    rate by `min_gain` and giving no sequence more than `max_k` drafts. 1.10 (it was 1.05): served, ngram on chat at
    4 clients, where the rule's expected gain is a few percent, gave 0.93x-1.13x over off from one server start to
    the next (each start's table, and the windows, move by more than that gain; benchmarks/README.md); replayed at
    one stream, 1.05 -> 1.15 changed no workload's predicted gain by more than 0.01."""

    cost: CostTable
    min_gain: float = 1.10
    max_k: int = 8

    def worthwhile(self, n: int, rate: float) -> bool:
        """Whether drafts could pay in a step of `n` decoding sequences were every one as likely to be accepted as
        `rate` (the best acceptance among them): where not, the step need not ask the proposers."""
        return any(self.choose([Candidate(self.max_k, rate)] * n, budget=n * self.max_k))

    def choose(self, candidates: Sequence[Candidate], budget: int) -> list[int]:
        """Drafts for each candidate (every decoding sequence of the step, in any order; 0 for one that should
        verify none), using at most `budget` draft tokens in all."""
        n = len(candidates)
        out = [0] * n
        if n == 0 or budget <= 0:
            return out
        ks, row = np.asarray(self.cost.ks, dtype=np.float64), np.asarray(self.cost.row(n))
        base_ms = float(row[0])
        order = sorted((i for i in range(n) if candidates[i].offered > 0), key=lambda i: -candidates[i].rate)
        if not order:
            return out
        offered = np.array([candidates[i].offered for i in order], dtype=np.float64)
        rates = np.array([candidates[i].rate for i in order], dtype=np.float64)
        verifying = np.arange(1, len(order) + 1, dtype=np.float64)  # s: the s most confident verify
        best_rate, best = n / base_ms, (0, 0)
        for K in range(1, self.max_k + 1):
            k = np.minimum(offered, K)
            drafts = np.cumsum(k)
            gain = np.cumsum(_extra(rates, k))
            # s sequences verifying drafts / s drafts each on average: their share of a step where all n do.
            extra_ms = (np.interp(drafts / verifying, ks, row) - base_ms) * verifying / n
            rate = np.where(drafts <= budget, (n + gain) / (base_ms + extra_ms), 0.0)
            s = int(rate.argmax())
            if rate[s] > best_rate:
                best_rate, best = float(rate[s]), (K, s + 1)
        K, count = best
        if best_rate < self.min_gain * n / base_ms:
            return out
        for i in order[:count]:
            out[i] = min(K, candidates[i].offered)
        return out


def _extra(rates: np.ndarray, k: np.ndarray) -> np.ndarray:
    """expected_extra over arrays: a (1 - a^k) / (1 - a), and k where a is 1."""
    one = rates >= 1.0
    safe = np.where(one, 0.5, rates)
    out: np.ndarray = np.where(one, k, safe * (1.0 - safe**k) / (1.0 - safe))
    return out
