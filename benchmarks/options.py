"""The options every feature mode of benchmarks/run.py takes, and the name its results get."""

from __future__ import annotations

import argparse
import datetime
import shlex
from pathlib import Path

from benchmarks.modes import DEFAULT
from benchmarks.writer import RESULTS, device_slug


def parser(mode: str, doc: str | None) -> argparse.ArgumentParser:
    """A mode's parser with the common options; the mode adds its own."""
    p = argparse.ArgumentParser(
        prog=f"benchmarks/run.py --mode {mode}",
        description=(doc or "").split("\n\n")[0],
        epilog=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes, short windows; not a measurement")
    p.add_argument("--model", default=None, help="model spec for llmserve.models.load_model; unset: the default")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where the results go (default: benchmarks/results)")
    p.add_argument("--name", default=None, help="results file stem; default <date>-<device>-<mode>[-quick]")
    return p


def command(mode: str, argv: list[str]) -> str:
    """The command line that reruns this mode with these arguments."""
    return shlex.join(["python", "benchmarks/run.py", *([] if mode == DEFAULT else ["--mode", mode]), *argv])


def result_name(args: argparse.Namespace, stem: str) -> str:
    """`--name`, else <date>-<device>-<stem>[-quick] (a quick run never overwrites a measured one)."""
    if args.name:
        return str(args.name)
    parts = [datetime.date.today().isoformat(), device_slug(args.device), stem]
    return "-".join(parts + (["quick"] if args.quick else []))


def add_windows(
    p: argparse.ArgumentParser, sets: str, *, window_s: float, warmup_s: float, max_new_tokens: int
) -> None:
    """The options of a mode that alternates its systems window by window (benchmarks/window.py): `--windows`
    sets of one window per system (`sets` says what a set holds), their lengths, the closed-loop clients and their
    requests' size."""
    p.add_argument("--windows", type=int, default=3, help=f"sets of windows ({sets})")
    p.add_argument("--window-s", type=float, default=window_s)
    p.add_argument("--warmup-s", type=float, default=warmup_s)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)


def parse_windows(
    p: argparse.ArgumentParser, argv: list[str], quick_window_s: float = 3.0, quick_max_new_tokens: int = 8
) -> argparse.Namespace:
    """The arguments; with --quick one set of short windows, few clients and tokens: a smoke run."""
    args = p.parse_args(argv)
    if args.quick:
        args.windows, args.window_s, args.warmup_s, args.clients = 1, quick_window_s, 1.0, 4
        args.max_new_tokens = quick_max_new_tokens
    return args
