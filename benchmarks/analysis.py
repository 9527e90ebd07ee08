"""From raw runs to the figures the report shows: points per concurrency, ratios, the issue's targets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.loadgen import compose_fifo
from benchmarks.metrics import PointSummary, WindowStats, ratio, relative_spread, summarize
from benchmarks.roofline import Roofline
from benchmarks.runner import SystemRun
from benchmarks.settings import Plan


def system_points(run: SystemRun, plan: Plan) -> dict[int, PointSummary]:
    """Every measured point, plus composed points for single-worker systems above their batch size."""
    by_concurrency = {m.schedule.concurrency: m for m in run.measurements}
    points = {c: summarize(run.system, m) for c, m in by_concurrency.items()}
    g = run.group_size
    base = by_concurrency.get(g) if g else None
    if base is not None:
        for c in plan.concurrencies:
            if c > g and c % g == 0:
                points[c] = summarize(run.system, compose_fifo(base, c, g))
    return dict(sorted(points.items()))


def floor_share(roof: Roofline, window: WindowStats) -> float | None:
    """The roofline's least time for the work this window served, over the window's length."""
    if not window.window_s or window.decode_context_mean is None:
        return None
    tokens = round(window.output_tokens_per_s * window.window_s)
    decoded = tokens - len(window.prefills)  # each of those prompts' prefill sampled its first token
    return roof.work_floor_s(window.prefills, decoded, window.decode_context_mean) / window.window_s


def floor_shares(roof: Roofline, point: PointSummary) -> list[float]:
    """`floor_share` of each of the point's windows that has one."""
    return [x for x in (floor_share(roof, w) for w in point.windows) if x is not None]


@dataclass(slots=True)
class Target:
    """One of issue 5's targets: the measured value, the bar, and whether the gap exceeds the noise."""

    name: str
    value: float | None
    bar: str
    met: bool | None
    noise: float | None


def targets(points: dict[str, dict[int, PointSummary]], main: int, roof: Roofline | None) -> list[Target]:
    def get(system: str, figure: str) -> float | None:
        p = points.get(system, {}).get(main)
        return p.mean.get(figure) if p else None

    def noise(*systems: str, figure: str = "output_tokens_per_s") -> float | None:
        spreads = [relative_spread(points[s][main], figure) for s in systems if main in points.get(s, {})]
        spreads = [x for x in spreads if x is not None]
        return max(spreads) if spreads else None

    tps = "output_tokens_per_s"

    def versus(name: str, system: str, base: str, bar: str, met: Callable[[float], bool], figure: str = tps) -> Target:
        """`system`'s figure over `base`'s, against the bar; the noise is the larger of the two systems' spreads."""
        r = ratio(get(system, figure), get(base, figure))
        return Target(name, r, bar, None if r is None else met(r), noise(system, base, figure=figure))

    out = [
        versus("llmserve / dynamic batching, output tokens/s", "llmserve", "dynamic", ">= 2.5", lambda r: r >= 2.5),
        versus("llmserve / transformers CB, output tokens/s", "llmserve", "hf_continuous", ">= 4", lambda r: r >= 4),
    ]
    engine = points.get("llmserve", {}).get(main)
    if roof is not None and engine is not None and (shares := floor_shares(roof, engine)):
        r = sum(shares) / len(shares)
        spread = (max(shares) - min(shares)) / r if len(shares) > 1 and r else None
        out.append(Target("llmserve / roofline floor of the work it served", r, ">= 0.5", r >= 0.5, spread))
    out.append(versus("gRPC / in-process, output tokens/s", "llmserve_grpc", "llmserve", ">= 0.9", lambda r: r >= 0.9))
    r = ratio(get("llmserve_grpc_metrics", tps), get("llmserve_grpc", tps))
    spread = noise("llmserve_grpc", "llmserve_grpc_metrics")
    out.append(
        Target(
            "gRPC with metrics on / off, output tokens/s",
            r,
            "within noise of 1",
            None if r is None or spread is None else abs(r - 1) <= spread,
            spread,
        )
    )
    p99 = "ttft_p99_s"
    out.append(
        versus("llmserve / dynamic batching, TTFT P99", "llmserve", "dynamic", "<= 0.333", lambda r: r <= 1 / 3, p99)
    )
    return out
