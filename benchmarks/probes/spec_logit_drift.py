"""Do logits computed as one of k + 1 verification positions equal the same logits computed by a decode step?

    python benchmarks/probes/spec_logit_drift.py [--k 4] [--tokens 96]

Greedy speculation is exact when each position's argmax is the one a plain decode step computes. The CPU backend
computes a decode token through its compiled kernel and k + 1 positions through the chunk path (SDPA), so the two
may round differently. This probe runs SmolLM2-135M (float32) on the real CPU backend over a chat-templated text:
once decoding its greedy answer one token per step, once verifying it k + 1 positions per step (the drafts being the
answer itself, so every step is a full acceptance), and reports the largest logit difference, the smallest margin
between the best two logits seen, and how many argmaxes differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paths import make_importable  # noqa: E402

make_importable()

from llmserve.process import configure_process  # noqa: E402

configure_process()

import torch  # noqa: E402

from llmserve.engine.backends import create_backend  # noqa: E402
from llmserve.engine.block_pool import BlockPool  # noqa: E402
from llmserve.engine.config import EngineConfig  # noqa: E402
from llmserve.engine.plan import SeqStep, StepPlan  # noqa: E402
from llmserve.engine.request import GenerationRequest, Sequence  # noqa: E402
from llmserve.models import load_model  # noqa: E402


@torch.inference_mode()
def run(backend: object, pool: BlockPool, prompt: list[int], answer: list[int] | None, n: int, k: int) -> list:
    """Logits at each answer position: decoding one token per step (answer None: greedy, building it), or
    verifying `answer` k + 1 positions per step."""
    ids = tuple(prompt)
    seq = Sequence(GenerationRequest("probe", ids), list(ids), 0.0, 1)
    seq.block_table = pool.allocate(pool.blocks_for(len(prompt) + n + k + 1))
    out: list[torch.Tensor] = []

    def forward(start: int, tokens: list[int], rows: int) -> torch.Tensor:
        plan = StepPlan([SeqStep(seq, start, tokens, seq.block_table, seq.sample_row())])
        input_ids, positions, _, batch = backend.prepare(plan)  # type: ignore[attr-defined]
        keep = torch.arange(len(tokens) - rows, len(tokens))
        return backend.forward(input_ids, positions, keep, batch)  # type: ignore[attr-defined]

    logits = forward(0, list(prompt), 1)
    out.append(logits[0])
    tokens = list(prompt) + ([int(logits[0].argmax())] if answer is None else [answer[0]])
    while len(out) < n:
        start = len(tokens) - 1
        if answer is None:
            logits = forward(start, tokens[start:], 1)
            out.append(logits[0])
            tokens.append(int(logits[0].argmax()))
        else:
            done = len(out)  # tokens hold answer[:done]; its last is uncomputed
            drafts = answer[done : done + k]
            logits = forward(start, [tokens[start], *drafts], len(drafts) + 1)
            out.extend(logits)
            tokens.extend(answer[done : done + len(drafts) + 1])  # every draft accepted, and the bonus token
    pool.release(seq.block_table)
    return out[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    loaded = load_model(None, device="cpu", dtype="float32")
    backend = create_backend(loaded, EngineConfig(block_size=16, kv_cache_tokens=4096), max_model_len=2048)
    pool = BlockPool(backend.num_blocks, 16)
    tokenizer = loaded.tokenizer
    for question in ("Rewrite in plain English: " + (__doc__ or ""), "Why is the sky blue?"):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
        plain = run(backend, pool, prompt, None, args.tokens, args.k)
        answer = [int(x.argmax()) for x in plain]
        verified = run(backend, pool, prompt, answer, args.tokens, args.k)
        diff = max(float((a - b).abs().max()) for a, b in zip(plain, verified, strict=True))
        flips = sum(int(a.argmax()) != int(b.argmax()) for a, b in zip(plain, verified, strict=True))
        margin = min(float(x.topk(2).values[0] - x.topk(2).values[1]) for x in plain)
        print(
            f"prompt {len(prompt)} tokens, {args.tokens} answer tokens, k={args.k}: largest logit difference "
            f"{diff:.2e}, smallest top-2 margin {margin:.2e}, argmax differs at {flips} positions"
        )


if __name__ == "__main__":
    main()
