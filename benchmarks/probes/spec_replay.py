"""Speculative decoding at one stream, offline: the step-cost table at 1 row, and each proposer and load rule replayed
over SmolLM2's own greedy answers to the benchmark's prompts (issue 33, phase 3).

    python benchmarks/run.py --mode spec-replay --step-cost            # decode step ms, 1 row, 1..16 query tokens
    python benchmarks/run.py --mode spec-replay --answers 48           # greedy answers -> .cache/spec-replay.json
    python benchmarks/run.py --mode spec-replay --replay [--table T]   # every proposer over those answers

Greedy speculation emits exactly the greedy answer, so a proposer's run over an answer is simulated without the
model: at each decode step the proposer drafts from the prompt and the answer so far, the load rule (policy.Policy,
with each request's policy.Acceptance, as the Drafter asks it) picks k, the drafts that match the answer's next
tokens are accepted, plus the model's own token. The step's time is read from the step-cost table; the predicted
gain is the decode time without drafts (one base step per token) over the time with them. It leaves out the host
work of a verifying step (rollback, books) and of the proposer, so it is an upper bound for the served figure.
The answers are the first --answers prompts of `edit` and `chat` (benchmarks/spec_workloads.py) in order, as the
served benchmark sends them at 1 client; the suffix proposer sees them in that order under one identity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import spec_workloads
from benchmarks.paths import ROOT
from llmserve.engine.spec.ngram import NgramConfig, NgramProposer
from llmserve.engine.spec.policy import Acceptance, Candidate, CostTable, Policy

CACHE = ROOT / ".cache" / "spec-replay.json"
MAX_NEW = 128


def step_cost(repeats: int, batches: tuple[int, ...], ks: tuple[int, ...]) -> dict[str, Any]:
    """The engine's own step (schedule, forward, sampling, books) timed by calibrate.py's method, more repeats."""
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.core.engine_core import EngineCore
    from llmserve.engine.spec.calibrate import calibrate, table_rows
    from llmserve.models import load_model

    loaded = load_model(None, device="cpu", dtype="float32")
    config = EngineConfig(speculative="ngram", max_num_batched_tokens=512)
    core = EngineCore(loaded, config)
    assert core.speculation is not None
    drafter, seqs, tokens = core.speculation.drafter, config.max_num_seqs, config.max_num_batched_tokens
    runs = [table_rows(calibrate(core, drafter, seqs, tokens, batches, ks, repeats)) for _ in range(2)]
    return {"batches": batches, "ks": ks, "repeats": repeats, "runs": runs}


async def answers(count: int) -> dict[str, Any]:
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.frontend.async_engine import AsyncEngine
    from llmserve.engine.frontend.request import GenerationRequest, SamplingParams, StoppingParams
    from llmserve.models import load_model

    loaded = load_model(None, device="cpu", dtype="float32")
    tokenizer = loaded.tokenizer
    engine = AsyncEngine(loaded, EngineConfig(max_num_seqs=16, kv_cache_tokens=65536, max_num_batched_tokens=1024))
    await engine.start()

    def chat(text: str) -> tuple[int, ...]:
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tuple(tokenizer.encode(rendered, add_special_tokens=False))

    jobs = [("edit", t) for t in spec_workloads.edit_prompts()[:count]]
    jobs += [("chat", t) for t in spec_workloads.chat_prompts()[:count]]

    async def one(i: int, text: str) -> list[int]:
        request = GenerationRequest(f"r{i}", chat(text), SamplingParams(), StoppingParams(max_new_tokens=MAX_NEW))
        tokens: list[int] = []
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
        return tokens

    start = time.monotonic()
    got = await asyncio.gather(*(one(i, text) for i, (_, text) in enumerate(jobs)))
    took = time.monotonic() - start
    await engine.shutdown()
    samples = [{"workload": w, "prompt": list(chat(t)), "answer": a} for (w, t), a in zip(jobs, got, strict=True)]
    return {"max_new_tokens": MAX_NEW, "seconds": took, "samples": samples}


# -- the replay ---------------------------------------------------------------------------------------------

Propose = Callable[[int, list[int], int], list[int]]


class Run:
    """One proposer's state over a workload's answers: propose(key, tokens, k), start/end bracket an answer."""

    def __init__(self, name: str, make: Callable[[], tuple[Propose, Callable[..., None], Callable[..., None]]]):
        self.name = name
        self.propose, self.start, self.end = make()


def ngram(config: NgramConfig) -> Callable[[], tuple[Propose, Callable[..., None], Callable[..., None]]]:
    def make() -> tuple[Propose, Callable[..., None], Callable[..., None]]:
        p = NgramProposer(config)
        return p.propose, lambda key, prompt: None, lambda key, tokens: p.release(key)

    return make


def suffix(**overrides: Any) -> Callable[[], tuple[Propose, Callable[..., None], Callable[..., None]]]:
    from llmserve.engine.spec.suffix import SuffixConfig, SuffixProposer

    def make() -> tuple[Propose, Callable[..., None], Callable[..., None]]:
        p = SuffixProposer(SuffixConfig(**(dict(k=16) | overrides)))
        return p.propose, lambda key, prompt: p.start(key, None, prompt), p.release

    return make


def hybrid(rule: str, config: NgramConfig, **overrides: Any) -> Callable[..., Any]:
    """`first`: ngram's guess, suffix's where ngram has none; `longer`: the longer of the two."""

    def make() -> tuple[Propose, Callable[..., None], Callable[..., None]]:
        ng, (sp, sstart, send) = ngram(config)(), suffix(**overrides)()

        def propose(key: int, tokens: list[int], k: int) -> list[int]:
            a = ng[0](key, tokens, k)
            if rule == "first" and a:
                return a
            b = sp(key, tokens, k)
            return a if len(a) >= len(b) else b

        def end(key: int, tokens: list[int]) -> None:
            ng[2](key, tokens)
            send(key, tokens)

        return propose, sstart, end

    return make


def replay(run: Run, samples: Sequence[dict[str, Any]], cost: CostTable, max_k: int, min_gain: float) -> dict:
    policy = Policy(cost, min_gain=min_gain, max_k=max_k)
    base = cost.step_ms(1, 0)
    tokens = steps = offered_steps = verify_steps = proposed = accepted = 0
    spent = 0.0
    ks: dict[int, int] = {}
    for key, sample in enumerate(samples):
        prompt, answer = sample["prompt"], sample["answer"]
        run.start(key, prompt)
        acceptance = Acceptance()
        pos = 1  # the first token comes from the prefill
        while pos < len(answer):
            context = prompt + answer[:pos]
            room = min(max_k, MAX_NEW - pos - 1)
            k = 0
            drafts: list[int] = []
            if policy.worthwhile(1, acceptance.rate) and room > 0:
                drafts = run.propose(key, context, room)
                offered_steps += bool(drafts)
                k = policy.choose([Candidate(len(drafts), acceptance.rate)], budget=room)[0]
            drafts = drafts[:k]
            good = 0
            while good < len(drafts) and pos + good < len(answer) and drafts[good] == answer[pos + good]:
                good += 1
            acceptance.update(len(drafts), good)
            if drafts:
                verify_steps += 1
                proposed += len(drafts)
                accepted += good
                ks[len(drafts)] = ks.get(len(drafts), 0) + 1
            emitted = min(good + 1, len(answer) - pos)
            pos += emitted
            tokens += emitted
            steps += 1
            spent += cost.step_ms(1, len(drafts))
        run.end(key, prompt + answer)
    return {
        "proposer": run.name,
        "max_k": max_k,
        "tokens_per_step": round(tokens / max(1, steps), 2),
        "offered_share": round(offered_steps / max(1, steps), 2),
        "verify_share": round(verify_steps / max(1, steps), 2),
        "acceptance": round(accepted / max(1, proposed), 3),
        "k_mode": max(ks, key=ks.__getitem__) if ks else 0,
        "predicted_gain": round(tokens * base / spent, 2) if spent else None,
    }


def runs() -> list[Run]:
    ng24, ng14, ng13 = NgramConfig(2, 4, 16), NgramConfig(1, 4, 16), NgramConfig(1, 3, 16)
    ng28 = NgramConfig(2, 8, 16)
    return [
        Run("ngram 2..4", ngram(ng24)),
        Run("ngram 2..4 earliest", ngram(NgramConfig(2, 4, 16, latest=False))),
        Run("ngram 1..4", ngram(ng14)),
        Run("ngram 1..3", ngram(ng13)),
        Run("ngram 2..8", ngram(ng28)),
        Run("ngram 3..8", ngram(NgramConfig(3, 8, 16))),
        Run("suffix", suffix()),
        Run("suffix factor 2", suffix(max_spec_factor=2.0)),
        Run("suffix factor 4", suffix(max_spec_factor=4.0)),
        Run("suffix factor 4 p0.05", suffix(max_spec_factor=4.0, min_token_prob=0.05)),
        Run("suffix factor 4 p0", suffix(max_spec_factor=4.0, min_token_prob=0.0)),
        Run("suffix depth 64", suffix(max_depth=64)),
        Run("suffix depth 64 factor 4", suffix(max_spec_factor=4.0, max_depth=64)),
        Run("ngram 2..4 then suffix d64", hybrid("first", ng24, max_depth=64)),
        Run("longer of ngram 2..4, suffix d64", hybrid("longer", ng24, max_depth=64)),
        Run("ngram 2..4 then suffix", hybrid("first", ng24)),
        Run("ngram 1..4 then suffix f4", hybrid("first", ng14, max_spec_factor=4.0)),
        Run("longer of ngram 2..4, suffix", hybrid("longer", ng24)),
        Run("longer of ngram 1..4, suffix f4", hybrid("longer", ng14, max_spec_factor=4.0)),
    ]


def table_of(rows: Sequence[dict[str, float]]) -> CostTable:
    """Batch 1 only, the median of the runs' cells."""
    cells: dict[int, list[float]] = {}
    for r in rows:
        if int(r["batch"]) == 1:
            cells.setdefault(int(r["k"]), []).append(float(r["forward_ms"]))
    ks = tuple(sorted(cells))
    return CostTable((1,), ks, (tuple(statistics.median(cells[k]) for k in ks),))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/run.py --mode spec-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--step-cost", action="store_true")
    p.add_argument("--answers", type=int, default=0, help="generate the greedy answers of this many prompts each")
    p.add_argument("--replay", action="store_true")
    p.add_argument("--table", type=Path, default=ROOT / ".cache" / "spec-step-cost.json")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--workloads", default="edit,chat")
    args = p.parse_args(argv)
    if args.step_cost:
        data = step_cost(args.repeats, (1, 2, 4), (0, 1, 3, 7, 15))
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(json.dumps(data, indent=1))
        for rows in data["runs"]:
            print(" ".join(f"b{int(r['batch'])}k{int(r['k'])}={r['forward_ms']:.1f}" for r in rows))
    if args.answers:
        data = asyncio.run(answers(args.answers))
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps(data))
        print(f"{len(data['samples'])} answers in {data['seconds']:.0f} s -> {CACHE}")
    if args.replay:
        table = table_of([r for rows in json.loads(args.table.read_text())["runs"] for r in rows])
        print("step ms at 1 row by k:", dict(zip(table.ks, (round(v, 1) for v in table.ms[0]), strict=True)))
        samples = json.loads(CACHE.read_text())["samples"]
        for workload in args.workloads.split(","):
            mine = [s for s in samples if s["workload"] == workload]
            print(f"\n{workload}: {len(mine)} answers, {sum(len(s['answer']) for s in mine)} tokens")
            for max_k in (8, 15):
                for run in runs():  # fresh proposers each time: the suffix trees keep the answers they saw
                    row = replay(run, mine, table, max_k, 1.05)
                    print(json.dumps(row), flush=True)
    return 0
