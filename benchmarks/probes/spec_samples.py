"""SmolLM2's real greedy answers on the three workloads of issue 33, for measuring draft proposers offline.

    python benchmarks/probes/spec_samples.py                 # writes .cache/spec-samples.json (~3 min)
    python benchmarks/probes/spec_samples.py --per-workload 8 --max-new 96

The workloads: (a) `edit`: rewriting, summarising or commenting a given text (stdlib docstrings and source, so
nothing is downloaded), high overlap with the prompt; (b) `json`: JSON-schema answers extracted from short made-up
bios and reviews, constrained by the engine's llguidance grammar; (c) `chat`: open questions. Every prompt goes
through the chat template and the engine in this process (float32, greedy), as `make run` serves it. The answers
are what a draft proposer is scored against (benchmarks/probes/spec_proposers.py): greedy speculative decoding
emits exactly these tokens, so the drafts a proposer would have made at each point, and how many of them match,
follow from the answer alone.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paths import ROOT, make_importable  # noqa: E402

make_importable()

DEFAULT_OUT = ROOT / ".cache" / "spec-samples.json"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "occupation", "hobbies"],
    "additionalProperties": False,
}
REVIEW_SCHEMA = {
    "type": "object",
    "properties": {
        "product": {"type": "string"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "items": {"type": "string"}},
        "cons": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["product", "rating", "pros", "cons", "summary"],
    "additionalProperties": False,
}
NAMES = ["Alice Moreau", "Ben Okafor", "Chen Wei", "Dana Kowalski", "Emil Larsen", "Farah Haddad", "Gita Rao"]
CITIES = ["Lyon", "Lagos", "Chengdu", "Krakow", "Aarhus", "Beirut", "Pune", "Porto"]
JOBS = ["nurse", "software engineer", "baker", "teacher", "architect", "pilot", "journalist"]
HOBBIES = [("chess", "cycling"), ("painting", "hiking", "jazz"), ("gardening",), ("running", "photography")]
PRODUCTS = ["wireless headphones", "a French press", "a hiking backpack", "an e-reader", "a robot vacuum"]
QUESTIONS = [
    "What are the main differences between a list and a tuple in Python?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "How do I make a simple tomato sauce?",
    "Explain what a hash table is to a beginner.",
    "What should I pack for a weekend hiking trip?",
    "Write a short poem about autumn.",
    "What is the difference between weather and climate?",
    "How can I get better at public speaking?",
    "Explain recursion with an example.",
    "What are some good habits for learning a new language?",
    "Why do cats purr?",
    "Describe how a bill becomes a law in simple terms.",
    "What is photosynthesis?",
    "Give me a plan for a productive morning.",
    "How does a refrigerator keep food cold?",
    "What are the benefits of regular exercise?",
    "Write a short story about a lost key.",
    "How do vaccines work?",
    "What is the best way to start saving money?",
    "Explain the rules of chess briefly.",
    "What causes earthquakes?",
    "How do I write a good cover letter?",
    "What is machine learning?",
]


def edit_prompts() -> list[str]:
    """Rewrite, summarise and comment: prose and code from the standard library (nothing downloaded)."""
    import argparse as ap
    import collections
    import functools
    import json as js
    import shutil
    import textwrap

    prose = [inspect.getdoc(m) or "" for m in (js, ap, collections, functools)]
    prose += [inspect.getdoc(f) or "" for f in (textwrap.wrap, shutil.copytree, functools.lru_cache)]
    prose = [p[:1200] for p in prose if len(p) > 200]
    code = [inspect.getsource(f) for f in (textwrap.dedent, shutil.copyfileobj, functools.total_ordering)]
    code += [inspect.getsource(f) for f in (collections.namedtuple,)]
    code = [c[:1500] for c in code]
    prompts = []
    for text in prose:
        prompts.append(f"Rewrite the following text in plain English, keeping every detail:\n\n{text}")
        prompts.append(f"Summarise the following text:\n\n{text}")
        prompts.append(f"Fix any spelling or grammar mistakes in the following text and return it in full:\n\n{text}")
    for source in code:
        prompts.append(f"Add a comment above each line of this Python code and return the whole code:\n\n{source}")
        prompts.append(f"Rename the variables of this Python code to clearer names, return the code:\n\n{source}")
    return prompts


def json_prompts() -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = []
    for i in range(len(NAMES) * 2):
        name, city, job = NAMES[i % len(NAMES)], CITIES[i % len(CITIES)], JOBS[(i * 3) % len(JOBS)]
        hobbies = " and ".join(HOBBIES[i % len(HOBBIES)])
        bio = f"{name} is {24 + 3 * i} years old and lives in {city}, where they work as a {job}. "
        bio += f"In their free time they enjoy {hobbies}."
        out.append((f"Extract the person's details from this bio as JSON.\n\nBio: {bio}", PERSON_SCHEMA))
    for i, product in enumerate(PRODUCTS * 2):
        good, bad = ("light", "battery life", "price", "design")[i % 4], ("noise", "size", "weight")[i % 3]
        review = f"I bought {product} last month. I love the {good}, but the {bad} disappoints me. "
        review += f"Overall I'd give it {1 + i % 5} out of 5."
        out.append((f"Turn this review into JSON.\n\nReview: {review}", REVIEW_SCHEMA))
    return out


async def generate_all(per_workload: int, max_new: int) -> dict:
    import torch

    from llmserve.engine.async_engine import AsyncEngine
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.request import (
        ConstraintKind,
        ConstraintSpec,
        GenerationRequest,
        SamplingParams,
        StoppingParams,
    )
    from llmserve.models import load_model

    torch.set_num_threads(2)
    loaded = load_model(None, device="cpu", dtype="float32")
    tokenizer = loaded.tokenizer
    engine = AsyncEngine(loaded, EngineConfig(max_num_seqs=32, kv_cache_tokens=131072, max_num_batched_tokens=2048))
    await engine.start()

    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids: list[int] = tokenizer.encode(rendered, add_special_tokens=False)
        return ids

    jobs: list[tuple[str, str, GenerationRequest]] = []
    for i, text in enumerate(edit_prompts()[:per_workload]):
        jobs.append(
            (
                "edit",
                text,
                GenerationRequest(
                    f"edit-{i}", tuple(chat(text)), SamplingParams(), StoppingParams(max_new_tokens=max_new)
                ),
            )
        )
    for i, (text, schema) in enumerate(json_prompts()[:per_workload]):
        spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        jobs.append(
            (
                "json",
                text,
                GenerationRequest(
                    f"json-{i}",
                    tuple(chat(text)),
                    SamplingParams(),
                    StoppingParams(max_new_tokens=max_new),
                    constraint=spec,
                ),
            )
        )
    for i, text in enumerate(QUESTIONS[:per_workload]):
        jobs.append(
            (
                "chat",
                text,
                GenerationRequest(
                    f"chat-{i}", tuple(chat(text)), SamplingParams(), StoppingParams(max_new_tokens=max_new)
                ),
            )
        )

    async def one(request: GenerationRequest) -> list[int]:
        tokens: list[int] = []
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
        return tokens

    start = time.monotonic()
    answers = await asyncio.gather(*(one(r) for _, _, r in jobs))
    took = time.monotonic() - start
    await engine.shutdown()
    samples = [
        {
            "workload": workload,
            "id": request.request_id,
            "schema": request.constraint.text if request.constraint is not None else None,
            "prompt": list(request.prompt_token_ids),
            "answer": answer,
            "answer_text": tokenizer.decode(answer, skip_special_tokens=True),
        }
        for (workload, _, request), answer in zip(jobs, answers, strict=True)
    ]
    return {
        "model": "SmolLM2-135M-Instruct",
        "greedy": True,
        "max_new_tokens": max_new,
        "seconds": took,
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-workload", type=int, default=24)
    parser.add_argument("--max-new", type=int, default=192)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    data = asyncio.run(generate_all(args.per_workload, args.max_new))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data))
    counts: dict[str, list[int]] = {}
    for s in data["samples"]:
        counts.setdefault(s["workload"], []).append(len(s["answer"]))
    for workload, lengths in counts.items():
        print(f"{workload}: {len(lengths)} answers, {sum(lengths)} tokens")
    print(f"{data['seconds']:.1f} s, written to {args.out}")


if __name__ == "__main__":
    main()
