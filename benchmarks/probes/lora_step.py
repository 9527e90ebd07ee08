"""Probe: the cost of LoRA rows in a whole engine step at 32 decode rows (issue 32), in process, no gRPC.

One EngineCore over the default model (float32, the fused CPU forward) with 4 adapters of rank 16 on every target
projection (made here with PEFT, as benchmarks/modes/lora.py makes them). 32 requests of 40-token prompts are
submitted under the adapters (row c under adapter c mod 4) or under the base model, stepped until every one is
decoding, then `--steps` decode steps are timed; rounds alternate (L B, B L, ...). With `--profile`, one more
stretch of each is run under torch.profiler and its operators' self CPU time printed.

    python benchmarks/probes/lora_step.py [--rounds 3] [--steps 20] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.modes.lora import ADAPTERS, make_adapters, prompts
from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.frontend.request import GenerationRequest, SamplingParams, StoppingParams
from llmserve.models import load_model


def start(core: EngineCore, lora: bool, prompt_ids: list[list[int]], tag: str, clients: int) -> list[int]:
    handles = []
    for c in range(clients):
        request = GenerationRequest(
            f"{tag}-{c}",
            tuple(prompt_ids[c % len(prompt_ids)]),
            sampling=SamplingParams(temperature=0.7, seed=c),
            stopping=StoppingParams(max_new_tokens=4000, ignore_eos=True),
            adapter=f"a{c % ADAPTERS}" if lora else None,
        )
        handles.append(core.submit(request))
    core.drain_inbox()
    for _ in range(200):  # until every prompt is in (40 tokens each, 512 per step)
        core.step()
        core.take_outputs()
        if core.scheduler.num_waiting == 0 and all_decoding(core):
            break
    for _ in range(3):
        core.step()
        core.take_outputs()
    return handles


def all_decoding(core: EngineCore) -> bool:
    return all(s.num_computed >= len(s.token_ids) - 1 for s in core.scheduler.running)


def timed(core: EngineCore, steps: int) -> float:
    """Median ms of `steps` steps."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t) * 1e3)
        core.take_outputs()
    return statistics.median(times)


def stop(core: EngineCore, handles: list[int]) -> None:
    for h in handles:
        core.abort(h)
    core.drain_inbox()
    for _ in range(3):
        core.step()
        core.take_outputs()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="llmserve-probe-lora-"))
    folders = make_adapters(None, root, ADAPTERS, 16)
    config = EngineConfig(loras=tuple((f"a{i}", str(f)) for i, f in enumerate(folders)), max_loras=ADAPTERS)
    core = EngineCore(load_model(None, device="cpu", dtype="float32"), config)
    core.warm_up()
    print(core.backend.description, f"threads {torch.get_num_threads()}", flush=True)
    prompt_ids = prompts(core.loaded.shape.vocab_size)
    ms: dict[str, list[float]] = {"lora": [], "base": []}
    for r in range(args.rounds):
        for mode in ("lora", "base") if r % 2 == 0 else ("base", "lora"):
            handles = start(core, mode == "lora", prompt_ids, f"{mode}{r}", args.clients)
            ms[mode].append(timed(core, args.steps))
            stop(core, handles)
        print({k: [round(v, 2) for v in vs] for k, vs in ms.items()}, flush=True)
    lora, base = statistics.median(ms["lora"]), statistics.median(ms["base"])
    print(f"decode step at {args.clients} rows: lora {lora:.2f} ms, base {base:.2f} ms, base/lora {base / lora:.3f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for mode in ("lora", "base"):
            handles = start(core, mode == "lora", prompt_ids, f"prof-{mode}", args.clients)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                timed(core, args.steps)
            stop(core, handles)
            print(f"--- {mode}: {args.steps} steps")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
