"""The three workloads of speculative decoding (issue 33), built from text on this machine (nothing downloaded).

(a) `edit`: rewriting, summarising or commenting a given text (stdlib docstrings and source), high overlap with the
prompt; (b) `json`: JSON-schema answers extracted from short made-up bios and reviews (the schema goes with the
request as a constraint); (c) `chat`: open questions. Used by `--mode speculative` (benchmarks/modes/speculative.py).
"""

from __future__ import annotations

import inspect

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
