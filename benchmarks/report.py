"""The ladder's results: its page (tables and method), its JSON (every figure) and PNG plots, written through
benchmarks/writer.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import runner, writer
from benchmarks.analysis import Target, floor_share
from benchmarks.labels import LABELS
from benchmarks.metrics import PointSummary, ratio, relative_spread
from benchmarks.roofline import Roofline
from benchmarks.runner import SystemRun
from benchmarks.settings import BASELINES, BenchSettings, Plan
from benchmarks.writer import loads, mib, num, pct, seconds, times


@dataclass(slots=True)
class BenchResult:
    """Everything a report shows; `sessions` is the session benchmark's JSON and markdown, when it ran."""

    name: str
    command: str
    settings: BenchSettings
    machine: dict
    mean_prompt_tokens: float
    roofline: Roofline | None
    runs: list[SystemRun]
    points: dict[str, dict[int, PointSummary]]
    targets: list[Target]
    wall_s: float
    sessions_json: dict | None = None
    sessions_markdown: str = ""
    notes: list[str] = field(default_factory=list)


def main_table(result: BenchResult) -> list[str]:
    c = result.settings.plan.main.concurrency
    base = {s: result.points.get(s, {}).get(c) for s in ("naive", "dynamic")}
    rows = [
        f"### {c} concurrent clients (mean of {result.settings.plan.main.windows} windows; "
        "± is the spread between them)",
        "",
        "| system | req/s | output tok/s | TTFT P50 / P99 | ITL P50 / P99 | E2E P50 / P99 | peak memory "
        "| × naive | × dynamic |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system, p in _points_at(result.points, c):
        m, sp = p.mean, p.spread
        tps = m["output_tokens_per_s"]
        label = LABELS.get(system, system) + (" ¹" if p.composed_from is not None else "")
        rows.append(
            f"| {label} | {num(m['requests_per_s'], 3)} | {num(tps, 1)} ± {num(sp['output_tokens_per_s'], 1)} "
            f"| {seconds(m['ttft_p50_s'])} / {seconds(m['ttft_p99_s'])} "
            f"| {seconds(m['itl_p50_s'])} / {seconds(m['itl_p99_s'])} "
            f"| {seconds(m['e2e_p50_s'])} / {seconds(m['e2e_p99_s'])} | {mib(p.peak_memory_bytes)} "
            f"| {times(ratio(tps, base['naive'].mean['output_tokens_per_s'] if base['naive'] else None))} "
            f"| {times(ratio(tps, base['dynamic'].mean['output_tokens_per_s'] if base['dynamic'] else None))} |"
        )
    rows += [
        "",
        "¹ single worker: service measured at its batch size (naive 1, dynamic "
        f"{result.settings.dynamic_max_batch}); the queue wait at this concurrency is composed from the measured "
        "service times (see Method). Throughput and ITL are measured as they are.",
        "",
        "Noise: relative spread between the two windows (a difference smaller than this is noise):",
        "",
        "| system | output tok/s | TTFT P99 | completed per window | errors |",
        "|---|---|---|---|---|",
    ]
    for system, p in _points_at(result.points, c):
        done = ", ".join(str(w.completed) for w in p.windows)
        errors = sum(w.errors for w in p.windows)
        rows.append(
            f"| {system} | {pct(relative_spread(p, 'output_tokens_per_s'))} "
            f"| {pct(relative_spread(p, 'ttft_p99_s'))} | {done} | {errors} |"
        )
    return rows


def sweep_table(result: BenchResult, figure: str, fmt) -> list[str]:
    concurrencies = sorted({c for by_c in result.points.values() for c in by_c})
    rows = ["| system | " + " | ".join(str(c) for c in concurrencies) + " |", "|---" * (len(concurrencies) + 1) + "|"]
    for system, by_c in result.points.items():
        cells = []
        for c in concurrencies:
            p = by_c.get(c)
            mark = "¹" if p is not None and p.composed_from is not None else ""
            cells.append(fmt(p.mean.get(figure)) + mark if p is not None else "")
        rows.append(f"| {system} | " + " | ".join(cells) + " |")
    return rows


def roofline_section(result: BenchResult) -> list[str]:
    r = result.roofline
    if r is None:
        return []
    pk = r.peak
    engine = result.points.get("llmserve", {}).get(r.batch)
    tps = engine.mean["output_tokens_per_s"] if engine else None
    return (
        [
            "## Roofline",
            "",
            f"- Measured on {pk.device} ({pk.dtype}): matmul {pk.matmul_flops_per_s / 1e9:,.1f} GFLOP/s; "
            f"read bandwidth {pk.read_bytes_per_s / 1e9:,.1f} GB/s (copy {pk.copy_bytes_per_s / 1e9:,.1f} GB/s, "
            "read+write counted).",
            f"- Decode step at {r.batch} sequences, mean context {r.mean_context:.0f} tokens: "
            f"{r.flops_per_step / 1e9:,.2f} GFLOP ({r.matmul_params / 1e6:,.1f} M matmul weights × 2 × {r.batch}, "
            f"plus attention) and {r.bytes_per_step / 2**20:,.0f} MiB read (weights once, plus the KV of {r.batch} "
            "sequences).",
            f"- Decode-step floor: {r.step_floor_s * 1000:.1f} ms per step ({r.bound}-bound), so at most "
            f"{r.max_decode_tokens_per_s:,.0f} decode tokens/s if steps held nothing but decodes "
            f"(llmserve: {pct(ratio(tps, r.max_decode_tokens_per_s))} of it).",
            f"- But every request also brings its prompt, {r.prefill_flops_per_request / 1e9:,.1f} GFLOP on average "
            f"(LM head once), and at {r.batch} concurrent the steps carry those chunks too. Counting prefill at peak "
            f"FLOP/s (it samples the first new token) plus one decode-step share per other generated token, the "
            f"**workload floor is "
            f"{r.max_output_tokens_per_s_with_prefill:,.1f} output tokens/s**.",
            f"- llmserve at {r.batch} concurrent: {num(tps, 1)} output tokens/s = "
            f"{pct(ratio(tps, r.max_output_tokens_per_s_with_prefill))} of the workload floor.",
        ]
        + (window_floor_lines(r, engine, result.mean_prompt_tokens) if engine else [])
        + [""]
    )


def window_floor_lines(r: Roofline, engine: PointSummary, mean_prompt: float) -> list[str]:
    """The floor of the work each window served, and llmserve's share of it (the issue's target)."""
    shares, per_window = [], []
    for w in engine.windows:
        share = floor_share(r, w)
        if share is None:
            continue
        shares.append(share)
        prompts = [new + cached for new, cached in w.prefills]
        mean = sum(prompts) / len(prompts) if prompts else 0.0
        per_window.append(
            f"{len(prompts)} prompts of mean {mean:.0f} tokens, mean context {w.decode_context_mean:.0f}: "
            f"floor {share * w.window_s:.1f} s of {w.window_s:.0f} s = {pct(share)}"
        )
    if not shares:
        return []
    return [
        f"- That floor assumes the workload's mean prompt ({mean_prompt:.0f} tokens); the few dozen requests a "
        "window serves average more or less. Each window's own work (the prompts whose first token came in it, "
        "the other tokens generated in it, at their mean context) has its own floor: "
        + "; ".join(per_window)
        + f". **llmserve ran at {pct(sum(shares) / len(shares))} of the roofline floor of the work it served**; "
        "that is the share the target holds it to.",
    ]


def baseline_timing(plan: Plan) -> str:
    b = plan.baseline_main
    if b is None:
        return ""
    return f" ({', '.join(BASELINES)}: {b.warmup_s:.0f} s warm-up, {b.windows} windows of {b.window_s:.0f} s)"


def method_section(result: BenchResult) -> list[str]:
    s = result.settings
    w = s.workload
    plan = s.plan
    sweep = ", ".join(f"{x.concurrency} ({x.warmup_s:.0f} s + {x.window_s:.0f} s)" for x in plan.sweep)
    return [
        "## Method",
        "",
        f"- Workload: seed {w.seed}; chat prompts (random words in the model's chat template, or random ids "
        f"without a tokenizer), log-uniform lengths {w.min_prompt}–{w.max_prompt} tokens "
        f"(mean {result.mean_prompt_tokens:.0f}); {w.max_new_tokens} new tokens each, EOS ignored; greedy.",
        f"- Closed loop: each client sends its next request when the last finishes. To start near the steady "
        "state rather than in lockstep, clients join over the first half of the warm-up and client i's first "
        "request asks for only (i+1)/C of the tokens (those count for throughput, not latency); single workers "
        f"start all at once with full requests. Main point: {plan.main.concurrency} clients, "
        f"{plan.main.warmup_s:.0f} s warm-up, "
        f"then {plan.main.windows} windows of {plan.main.window_s:.0f} s{baseline_timing(plan)}. "
        f"Sweep (warm-up + window): {sweep}; "
        f"swept: {', '.join(s.sweep_systems)} (the rest at the main point only).",
        "- Each output token is stamped when it reaches the client side. Per window: output tokens/s counts tokens "
        "stamped in it; req/s counts requests' worth of those tokens (a token is 1/N of a request asking for N; "
        "completions alone are too bursty for windows this short, their counts are listed); TTFT counts "
        "requests submitted after the warm-up "
        "whose first token came in it; ITL is every gap between consecutive tokens of a request ending in it; "
        "E2E counts requests finished in it. Requests still running at the end are aborted.",
        "- Single workers (naive; dynamic batching) are measured for real at their batch size, where the worker is "
        f"always busy and nothing queues ({runner.BASE_WARMUP_S:.0f} s warm-up, then windows filling the main "
        "point's time). With C clients such a worker runs the same groups back to back, so its "
        "throughput and token gaps are unchanged and each request also waits for the C/batch − 1 groups ahead; "
        "that wait is the sum of the measured service times of the groups before it (cyclically). Measuring it "
        "directly would take C × service time per sample (minutes here).",
        f"- llmserve (both): KV cache {s.engine.kv_cache_tokens} tokens, {s.engine.max_num_batched_tokens} tokens "
        f"per step, {s.engine.max_num_seqs} sequences. transformers' continuous batching gets the same KV capacity; "
        f'on the CPU it runs with "paged|eager" attention, 32-token pages and {s.hf_cpu_max_batch_tokens} tokens '
        "per step, its fastest in our trials (see systems/hf_continuous.py).",
        "- Peak memory: the kernel's RSS high-water mark of the serving process (the server subprocess for gRPC), "
        "reset before each point; on CUDA the allocator's peak in-process (gRPC: server RSS).",
        "- Each system runs in its own process (unless run inline), one after another, on the same machine.",
        "",
    ]


def targets_section(result: BenchResult) -> list[str]:
    rows = ["## Issue 5 targets", "", "| target | measured | bar | met | noise |", "|---|---|---|---|---|"]
    for t in result.targets:
        met = "–" if t.met is None else ("yes" if t.met else "no")
        rows.append(f"| {t.name} | {num(t.value)} | {t.bar} | {met} | ±{pct(t.noise)} |")
    return rows + [""]


def to_markdown(result: BenchResult, plots: list[Path]) -> list[str]:
    s = result.settings
    m = result.machine
    lines = [
        f"# llmserve benchmark: {result.name}",
        "",
        f"`{result.command}` — {m.get('date')} — whole run {result.wall_s / 60:.1f} min",
        "",
        f"Model {m.get('model')} ({s.dtype if s.dtype != 'auto' else m.get('dtype')}) on {m.get('device_name')}; "
        f"torch {m.get('torch')}, transformers {m.get('transformers')}; OpenMP for every system alike: "
        f"OMP_WAIT_POLICY {m.get('omp_wait_policy') or 'unset'}, GOMP_SPINCOUNT {m.get('gomp_spincount') or 'unset'}; "
        "load average before/after: "
        f"{m.get('loadavg_before')} / {m.get('loadavg_after')}.",
        "",
    ]
    lines += [f"> {note}" for note in result.notes] + ([""] if result.notes else [])
    lines += main_table(result) + [""]
    lines += ["### Output tokens/s by concurrency", ""] + sweep_table(
        result, "output_tokens_per_s", lambda v: num(v, 1)
    )
    lines += ["", "### TTFT P99 by concurrency", ""] + sweep_table(result, "ttft_p99_s", seconds) + [""]
    lines += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += roofline_section(result) + targets_section(result)
    if result.sessions_markdown:
        lines += [result.sessions_markdown, ""]
    lines += method_section(result)
    failed = [r for r in result.runs if r.error]
    if failed:
        lines += ["## Failures", ""] + [f"- {r.system}: {r.error}" for r in failed] + [""]
    lines += ["## Runs", "", "| system | wall | load avg before → after |", "|---|---|---|"]
    for r in result.runs:
        lines.append(f"| {r.system} | {r.wall_s:.0f} s | {loads(r.loadavg_before)} → {loads(r.loadavg_after)} |")
    return lines


def to_json(result: BenchResult) -> dict:
    return {
        "name": result.name,
        "command": result.command,
        "settings": json.loads(result.settings.to_json()),
        "machine": result.machine,
        "mean_prompt_tokens": result.mean_prompt_tokens,
        "roofline": result.roofline.to_json() if result.roofline else None,
        "points": {s: {str(c): p.to_json() for c, p in by_c.items()} for s, by_c in result.points.items()},
        "targets": [asdict(t) for t in result.targets],
        "runs": [
            {k: v for k, v in asdict(r).items() if k != "measurements"}
            | {"measured_concurrencies": [m.schedule.concurrency for m in r.measurements]}
            for r in result.runs
        ],
        "sessions": result.sessions_json,
        "wall_s": result.wall_s,
        "notes": result.notes,
    }


def write_plots(result: BenchResult, out_dir: Path) -> list[Path]:
    """The two plots; none (with a note) where matplotlib is missing, as it may be on a bare GPU machine."""
    try:
        from benchmarks.plots import plot_vs_concurrency
    except ImportError as exc:
        result.notes.append(f"No plots: {exc}.")
        return []
    stem = out_dir / result.name
    return [
        plot_vs_concurrency(
            result.points,
            "output_tokens_per_s",
            "output tokens/s",
            f"Throughput — {result.name}",
            Path(f"{stem}-throughput.png"),
        ),
        plot_vs_concurrency(
            result.points,
            "ttft_p99_s",
            "TTFT P99 (s)",
            f"Time to first token, P99 — {result.name}",
            Path(f"{stem}-ttft-p99.png"),
            log_y=True,
        ),
    ]


def write(result: BenchResult, out_dir: Path) -> Path:
    """Write the plots, then the JSON and the page; returns the page's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(result, out_dir)
    return writer.write(out_dir, result.name, to_json(result), to_markdown(result, plots))


def _points_at(points: dict[str, dict[int, PointSummary]], c: int) -> Iterator[tuple[str, PointSummary]]:
    """Each system's point at `c` concurrent clients, for the systems measured there, in the table's order."""
    return ((system, by_c[c]) for system, by_c in points.items() if c in by_c)
