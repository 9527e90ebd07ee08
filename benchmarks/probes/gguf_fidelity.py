"""Fidelity of a GGUF's block path (issue 52): 16 chat prompts x 64 greedy tokens from the default model's blocks
with float rows (all 16 at once, in chunks of 48 tokens, in a pool that preempts) against the float32 path (the file
dequantized, each prompt alone: transformers' `generate`'s tokens, as the engine's exactness tests hold). The int8
rows too, for the count docs/cpu-dtypes.md cites.

    python benchmarks/probes/gguf_fidelity.py [--out FILE.json]
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]
from llmserve.process_settings import configure_process  # noqa: E402

configure_process()
from llmserve.engine.config import EngineConfig  # noqa: E402
from llmserve.engine.frontend.async_engine import AsyncEngine  # noqa: E402
from llmserve.engine.types.request import GenerationRequest, StoppingParams  # noqa: E402
from llmserve.models.loader import load_model  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "What is 17 times 23?",
    "Describe the water cycle.",
    "Give me three tips for sleeping better.",
    "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet.",
    "How many legs does a spider have?",
    "Explain photosynthesis to a child.",
    "Name the planets of the solar system.",
    "What is the boiling point of water?",
    "Write a short poem about autumn.",
    "What is machine learning?",
    "How do I make a cup of tea?",
]


async def tokens(engine: AsyncEngine, request: GenerationRequest) -> list[int]:
    out: list[int] = []
    async for delta in engine.generate(request):
        out += delta.token_ids
    return out


async def main() -> dict[str, dict[str, float]]:
    dense = load_model(None, device="cpu", dtype="float32")
    tok = dense.tokenizer
    reqs = [
        GenerationRequest(
            f"q{i}",
            tuple(
                tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
                    "input_ids"
                ]
            ),
            stopping=StoppingParams(64, ignore_eos=True),
        )
        for i, q in enumerate(QUESTIONS)
    ]
    engine = AsyncEngine(dense, EngineConfig(kv_cache_tokens=4096, max_num_seqs=8))
    await engine.start()
    expected = [await tokens(engine, r) for r in reqs]
    await engine.shutdown()
    result = {}
    for act in ("float32", "int8"):
        blocks = load_model(None, device="cpu", dtype="gguf", gguf_activations=act)
        engine = AsyncEngine(blocks, EngineConfig(kv_cache_tokens=640, max_num_seqs=16, max_num_batched_tokens=48))
        await engine.start()
        got = await asyncio.gather(*(tokens(engine, r) for r in reqs))
        await engine.shutdown()
        same = sum(g == e for g, e in zip(got, expected, strict=True))
        agree = [
            next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), 64) / 64
            for g, e in zip(got, expected, strict=True)
        ]
        result[act] = {
            "identical": same,
            "of": len(reqs),
            "mean_agreement_before_first_difference": sum(agree) / len(agree),
        }
        print(act, result[act], flush=True)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the counts as JSON")
    args = parser.parse_args()
    counts = asyncio.run(main())
    if args.out is not None:
        args.out.write_text(json.dumps(counts, indent=2) + "\n")
