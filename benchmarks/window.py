"""One measurement window of closed-loop clients on the monotonic clock, for the modes that alternate systems window
by window (structured, gateway, LoRA, speculative): a warm-up that is not counted, then `window_s` that is.

Each request reports its messages as (arrival time, tokens): the window counts the tokens that arrived inside it, so a
request that began before it or ran past its end counts only its share. Time to first token is kept for requests that
began inside the window, the decode rate (tokens after the first message over the time from the first message to the
last) for finished requests whose first message came inside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from benchmarks.metrics import percentile

Arrival = tuple[float, float]  # (time.monotonic() on arrival, tokens in the message)
T = TypeVar("T")


@dataclass(slots=True)
class Window:
    counted_from: float
    end: float
    tokens: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    decode_rates: list[float] = field(default_factory=list)
    open: int = 0  # requests begun and not yet done

    @classmethod
    def starting_now(cls, warmup_s: float, window_s: float) -> Window:
        counted_from = time.monotonic() + warmup_s
        return cls(counted_from, counted_from + window_s)

    @property
    def window_s(self) -> float:
        return self.end - self.counted_from

    @property
    def over(self) -> bool:
        return time.monotonic() >= self.end

    def inside(self, t: float) -> bool:
        return self.counted_from <= t < self.end

    def begin(self) -> float:
        """A request begins now: its start time, for `done`."""
        self.open += 1
        return time.monotonic()

    def done(self, began: float, arrivals: Sequence[Arrival], finished: bool = True) -> None:
        """A request that began at `began` has ended, with its messages' `arrivals`; `finished` False for one cut off
        at the window's end (its tokens count, its decode rate does not)."""
        self.open -= 1
        self.tokens += sum(n for t, n in arrivals if self.inside(t))
        if not arrivals:
            return
        (first, first_n), last = arrivals[0], arrivals[-1][0]
        if self.inside(began):
            self.ttfts.append(first - began)
        if finished and last > first and first >= self.counted_from:
            self.decode_rates.append((sum(n for _, n in arrivals) - first_n) / (last - first))

    def calls(self, client: int, items: Sequence[T]) -> Iterator[tuple[int, T]]:
        """Closed-loop client number `client`'s calls until the window is over: (k, the call's item), k counting
        from 1 (the modes seed each call with it), the items taken in turn from the client's own first one."""
        k = 0
        while not self.over:
            item = items[(client + k) % len(items)]
            k += 1
            yield k, item

    async def count(self, responses: AsyncIterator[Any]) -> None:
        """Read one call's stream of responses (llmserve_client's, with `token_ids`) to its end, counted here: the call
        begins now, each response's tokens arrive when it does."""
        began, arrivals = self.begin(), []
        async for response in responses:
            if response.token_ids:
                arrivals.append((time.monotonic(), float(len(response.token_ids))))
        self.done(began, arrivals)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s


def spread(arrivals: Sequence[float], tokens: int) -> list[Arrival]:
    """Messages whose token counts are not known one by one (smg's chunks): `tokens` spread evenly over them."""
    return [(t, tokens / len(arrivals)) for t in arrivals] if arrivals else []


def ttft_summary(samples: Sequence[float]) -> dict[str, float | int | None]:
    """P50 and P99 of time-to-first-token samples in seconds (None without a sample), and their count, for a JSON."""
    p50, p99 = percentile(samples, 50), percentile(samples, 99)
    return {
        "p50": None if p50 is None else round(p50, 3),
        "p99": None if p99 is None else round(p99, 3),
        "n": len(samples),
    }


def window_ratios(values: Sequence[float], bases: Sequence[float]) -> tuple[list[float | None], float | None]:
    """Each window's (or set's) value over its base's, rounded to 3 places (None where the base window got no
    tokens, as a smoke run's may), and the median of those there are."""
    ratios = [None if base == 0 else round(value / base, 3) for value, base in zip(values, bases, strict=True)]
    known = [r for r in ratios if r is not None]
    return ratios, round(statistics.median(known), 3) if known else None
