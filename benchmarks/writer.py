"""The one result writer: every mode's `<name>.json` (its figures) and `<name>.md` (the page a reader opens), and
the formatting of the figures in those pages.

A mode builds its page from its JSON alone, so a page can be written again from a run's JSON without measuring.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.paths import ROOT
from llmserve.cpu_features import cpu_level, cpu_name

if TYPE_CHECKING:
    from llmserve.engine.types.model import LoadedModel

RESULTS = ROOT / "benchmarks" / "results"


def seconds(value: float | None) -> str:
    """Seconds, compactly: milliseconds below one."""
    if value is None:
        return "–"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def times(value: float | None) -> str:
    """A ratio, as 1.23×."""
    return "–" if value is None else f"{value:.2f}×"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.0f}%"


def mib(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:,.0f} MiB"


def loads(values: Sequence[float] | None) -> str:
    return " ".join(f"{v:.1f}" for v in values) if values else "–"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def device_slug(device: str) -> str:
    """`cpu`, or the GPU's name (nvidia-h200) for a CUDA device: the part of a results name that says where."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return slug(torch.cuda.get_device_name(torch.device(device)))


@dataclass(slots=True)
class Run:
    """One mode's run: what it was called with, when, and the machine's load around it (the header of its page)."""

    command: str
    started: float = field(default_factory=time.perf_counter)
    date: str = field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))
    loadavg_before: list[float] = field(default_factory=lambda: [round(x, 2) for x in os.getloadavg()])
    model: dict[str, str] = field(default_factory=dict)

    def measured_on(self, loaded: LoadedModel) -> None:
        """Record the model the run measured (its name, dtype and device)."""
        dtype = str(loaded.dtype).removeprefix("torch.")
        self.model = {"model": loaded.name, "dtype": dtype, "device": str(loaded.device)}

    def load(self, args: argparse.Namespace) -> LoadedModel:
        """The model the run measures, as the mode's --model, --device and --dtype name it, recorded (`measured_on`)."""
        from llmserve.models.loader import load_model

        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
        self.measured_on(loaded)
        return loaded

    def facts(self) -> dict[str, Any]:
        """The run's facts for its JSON, taken at the end."""
        return {
            "command": self.command,
            "date": self.date,
            **self.model,
            "cpu": f"{cpu_name()} ({cpu_level()})",
            "wall_s": round(time.perf_counter() - self.started, 1),
            "loadavg_before": self.loadavg_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        }


def header(title: str, run: dict[str, Any]) -> list[str]:
    """A page's first lines: its title, the command, the date, the model, the whole run's time and the load
    around it."""
    model = f" {run['model']} ({run['dtype']}) on {run['device']};" if "model" in run else ""
    cpu = f" CPU {run['cpu']};" if "cpu" in run else ""
    return [
        f"# {title}",
        "",
        f"`{run['command']}` — {run['date']} —{model}{cpu} whole run {run['wall_s']:.0f} s; "
        f"load average before / after: {loads(run['loadavg_before'])} / {loads(run['loadavg_after'])}.",
        "",
    ]


def write(out_dir: Path, name: str, data: dict[str, Any], markdown: Sequence[str]) -> Path:
    """Write `<name>.json` and `<name>.md` into `out_dir`; returns the page's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    page = out_dir / f"{name}.md"
    page.write_text("\n".join(markdown) + "\n")
    print(f"wrote {page}", file=sys.stderr)
    return page


def publish(
    run: Run,
    out_dir: Path,
    name: str,
    title: str,
    figures: dict[str, Any],
    section: Callable[[dict[str, Any]], list[str]],
) -> Path:
    """A feature mode's results: its figures with the run's facts as JSON, and a page of the header and its
    section (built from that JSON)."""
    data = {"run": run.facts(), **figures}
    return write(out_dir, name, data, header(title, data["run"]) + section(data))
