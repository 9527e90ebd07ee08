"""PNG plots (matplotlib, Agg): one line per system over concurrency."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from benchmarks.labels import LABELS  # noqa: E402
from benchmarks.metrics import PointSummary  # noqa: E402


def plot_vs_concurrency(
    points: dict[str, dict[int, PointSummary]], figure: str, ylabel: str, title: str, path: Path, log_y: bool = False
) -> Path:
    """Plot `figure` (a key of PointSummary.mean) against concurrency for every system; composed points hollow."""
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for system, by_c in points.items():
        xs = [c for c, p in by_c.items() if p.mean.get(figure) is not None]
        if not xs:
            continue
        ys = [by_c[c].mean[figure] for c in xs]
        (line,) = ax.plot(xs, ys, marker="o", label=LABELS.get(system, system))
        hollow = [(c, by_c[c].mean[figure]) for c in xs if by_c[c].composed_from is not None]
        if hollow:
            ax.plot(*zip(*hollow, strict=True), "o", markerfacecolor="white", color=line.get_color())
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
