"""The modes of benchmarks/run.py: what `--mode NAME` runs (the ladder when no mode is named).

Each mode is a module with `main(argv: list[str]) -> int`, imported only when it runs (after run.py has set up
the process, before torch loads). To add one (a gateway, a dtype, LoRA, speculative decoding, ...):

1. write `benchmarks/modes/<name>.py`: build its parser with `benchmarks.options.parser(NAME, __doc__)` (the
   common --quick, --model, --device, --dtype, --out-dir, --name) and add its own options; measure; write its
   results with `benchmarks.writer.publish(run, out_dir, options.result_name(args, STEM), TITLE, figures,
   section)`, where `section(json) -> list[str]` builds its Markdown from the JSON alone;
2. add one `Mode` line below;
3. give `--quick` a size that runs in seconds, and add it to tests/benchmarks/test_modes.py.

Probes (benchmarks/probes/) are registered the same way: they are one-off measurements that keep their own
options; their figures live in the lab notes (benchmarks/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Mode:
    """A mode: its `--mode` name, the module whose `main(argv)` runs it, and one line for `--help`."""

    name: str
    module: str
    summary: str
    probe: bool = False


DEFAULT = "ladder"
MODES = {
    mode.name: mode
    for mode in (
        Mode("ladder", "benchmarks.modes.ladder", "naive → dynamic → continuous batching → llmserve (make bench)"),
        Mode("sessions", "benchmarks.modes.sessions", "session KV reuse: long history, multi-turn, append mode"),
        Mode("append", "benchmarks.modes.append", "append mode vs full resend, 32 sessions × 6 turns over gRPC"),
        Mode("kv-tiers", "benchmarks.modes.kv_tiers", "returning conversations: the disk tier vs recompute"),
        Mode("n", "benchmarks.modes.n_completions", "n = 4 completions vs four separate calls (make bench-n)"),
        Mode("structured", "benchmarks.modes.structured", "a JSON schema vs unconstrained (make bench-structured)"),
        Mode("dtypes", "benchmarks.modes.dtypes", "CPU float32 vs bfloat16 vs int8 over gRPC, llama.cpp beside"),
        Mode("gateway", "benchmarks.modes.gateway", "smg's OpenAI HTTP vs llmserve's gRPC (make bench-gateway)"),
        Mode("speculative", "benchmarks.modes.speculative", "speculative decoding on vs off (make bench-spec)"),
        Mode("lora", "benchmarks.modes.lora", "32 clients over 4 rank-16 LoRA adapters vs base (make bench-lora)"),
        Mode("embed", "benchmarks.modes.embed", "the library vs Embed, 1 and 32 texts a call (make bench-embed)"),
        Mode("gguf", "benchmarks.modes.gguf_blocks", "GGUF blocks vs llama-server on the same files (make bench-gguf)"),
        Mode("host-overhead", "benchmarks.probes.host_overhead", "host work per step, model call stubbed", True),
        Mode("frontend", "benchmarks.probes.frontend", "the serving path's ceiling, model call stubbed", True),
        Mode("ab", "benchmarks.probes.ab_checkouts", "same-run A/B of checkouts, alternated", True),
        Mode("gpu-check", "benchmarks.probes.gpu_check", "on a GPU: exactness, bf16 agreement, graphs", True),
        Mode("gpu-perf", "benchmarks.probes.gpu_perf", "on a GPU: issue 12's figures per shape", True),
    )
}
