"""What verifying k drafts costs on the CPU backend as it is: a forward with k + 1 query tokens per sequence
against one, at several batch sizes, with and without a prompt chunk in the step.

    flock -x /work/cpu.lock python benchmarks/probes/spec_verify_cost.py [--json out.json]
    python benchmarks/probes/spec_verify_cost.py --batches 1 4 --ks 0 4 --context 1024 --rounds 3

The real backend (`create_backend`: the fused forward, packed linears, the compiled decode kernel) runs SmolLM2-135M
in float32 on step plans built by hand: `batch` sequences with `context` tokens already in the cache (their KV is
whatever the cache holds: the work does not depend on the values), each computing 1 + k tokens, with the logits of
every one of those positions (what verification reads; without drafts only the last). `--chunk N` adds a prompt
chunk of N tokens to every step. Each configuration's forwards are timed in rounds, the configurations in
alternated order within a round (the machine's drift spreads over all of them); the figure is the median step.
Also timed: `sample()` over the k + 1 rows per sequence (greedy, and seeded top-p sampling at temperature 0.8 over
the model's real logits of a text), the verification's sampler work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paths import make_importable  # noqa: E402

make_importable()

from llmserve.process import configure_process  # noqa: E402

configure_process()  # as `python -m llmserve` does, before torch loads

import torch  # noqa: E402

from llmserve.engine.backends import create_backend  # noqa: E402
from llmserve.engine.backends.attention import ATTN_IMPLEMENTATION  # noqa: E402
from llmserve.engine.block_pool import BlockPool  # noqa: E402
from llmserve.engine.config import EngineConfig  # noqa: E402
from llmserve.engine.generators import Generators  # noqa: E402
from llmserve.engine.plan import SeqStep, StepPlan  # noqa: E402
from llmserve.engine.request import GenerationRequest, SamplingParams, Sequence  # noqa: E402
from llmserve.engine.sampler import sample  # noqa: E402
from llmserve.models import load_model  # noqa: E402

BLOCK = 16


class Bench:
    """The backend, and sequences with cached context to build plans from."""

    def __init__(self, max_seqs: int, context: int, chunk: int) -> None:
        self.loaded = load_model(None, device="cpu", dtype="float32")
        tokens = (max_seqs + 1) * (context + 64 + chunk)
        config = EngineConfig(
            block_size=BLOCK, kv_cache_tokens=tokens, max_num_seqs=max_seqs + 1, max_num_batched_tokens=4096
        )
        self.backend = create_backend(self.loaded, config, max_model_len=context + 64 + chunk + 1)
        self.pool = BlockPool(self.backend.num_blocks, BLOCK)
        self.context = context
        self.chunk = chunk
        self.seqs = [self._sequence(i, context + 32) for i in range(max_seqs)]
        self.prompt = self._sequence(max_seqs, chunk) if chunk else None

    def _sequence(self, seq_no: int, length: int) -> Sequence:
        ids = tuple(range(100, 100 + length))
        seq = Sequence(GenerationRequest(f"r{seq_no}", ids), list(ids), 0.0, seq_no)
        seq.block_table = self.pool.allocate(self.pool.blocks_for(length + 16))
        return seq

    def plan(self, batch: int, k: int) -> tuple[StepPlan, torch.Tensor]:
        """The step and the rows whose logits it keeps: every position of every decoding sequence (k + 1 each), and
        the chunk's last."""
        plan = StepPlan()
        for seq in self.seqs[:batch]:
            row = seq.sample_row()
            plan.seqs.append(
                SeqStep(seq, self.context, seq.token_ids[self.context : self.context + k + 1], seq.block_table, row)
            )
        if self.prompt is not None:
            seq = self.prompt
            plan.seqs.append(SeqStep(seq, 0, seq.token_ids[: self.chunk], seq.block_table, seq.sample_row()))
        decode_rows = batch * (k + 1)
        keep = list(range(decode_rows)) + ([decode_rows + self.chunk - 1] if self.chunk else [])
        return plan, torch.tensor(keep)

    @torch.inference_mode()
    def forward_ms(self, plan: StepPlan, keep: torch.Tensor) -> float:
        begin = time.perf_counter()
        ids, positions, _, batch = self.backend.prepare(plan)  # type: ignore[attr-defined]
        self.backend.forward(ids, positions, keep, batch)  # type: ignore[attr-defined]
        return (time.perf_counter() - begin) * 1e3


@torch.inference_mode()
def real_logits(bench: Bench) -> torch.Tensor:
    """The model's logits at every position of a real text (this module's docstring, chat-templated), for timing
    the sampler on distributions like a served answer's rather than on noise (top-p over flat noise sorts the
    whole vocabulary)."""
    tokenizer = bench.loaded.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": __doc__}], tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)[:256]
    model = bench.loaded.model
    model.set_attn_implementation("sdpa")
    try:
        logits: torch.Tensor = model(input_ids=torch.tensor([ids])).logits[0].float()
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return logits


def sampler_ms(logits: torch.Tensor, plan: StepPlan, sampled: bool, reps: int = 5) -> float:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1) if sampled else SamplingParams()
    rows = []
    for i in range(logits.shape[0]):
        base = plan.seqs[0].sample
        assert base is not None
        rows.append(type(base)(params, 1 if sampled else None, i, base.token_ids, (), False, 0))
    times = []
    for _ in range(reps):
        generators = Generators()
        begin = time.perf_counter()
        sample(logits, rows, generators)
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="forwards per configuration per round")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    bench = Bench(max(args.batches), args.context, args.chunk)
    configs = [(b, k) for b in args.batches for k in args.ks]
    for b, k in configs:  # warm-up: every shape once
        bench.forward_ms(*bench.plan(b, k))
    times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for b, k in order:
            plan, keep = bench.plan(b, k)
            for _ in range(args.reps):
                times[(b, k)].append(bench.forward_ms(plan, keep))
    rows = []
    real = real_logits(bench)
    for b in args.batches:
        base = statistics.median(times[(b, 0)])
        for k in args.ks:
            ms = statistics.median(times[(b, k)])
            plan, _ = bench.plan(b, k)
            logits = real[torch.arange(b * (k + 1)) % real.shape[0]]
            row = {
                "batch": b,
                "k": k,
                "context": args.context,
                "chunk": args.chunk,
                "forward_ms": ms,
                "ratio": ms / base,
                "spread_ms": [min(times[(b, k)]), max(times[(b, k)])],
                "sample_greedy_ms": sampler_ms(logits, plan, False),
                "sample_top_p_ms": sampler_ms(logits, plan, True),
            }
            rows.append(row)
            print(
                f"batch {b:3} k={k}  forward {ms:7.1f} ms  x{ms / base:4.2f} of k=0  "
                f"(min {row['spread_ms'][0]:.1f}, max {row['spread_ms'][1]:.1f})  sample greedy "
                f"{row['sample_greedy_ms']:5.2f} ms, top-p {row['sample_top_p_ms']:6.2f} ms",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
