"""The three workloads of speculative decoding (issue 33), built from text on this machine (nothing downloaded).

(a) `edit`: rewriting, summarising or commenting a given text (stdlib docstrings and source), high overlap with the
prompt; (b) `json`: JSON-schema answers extracted from short made-up bios and reviews (the schema goes with the
request as a constraint); (c) `chat`: open questions. Used by `--mode speculative` (benchmarks/modes/speculative.py).

Every prompt of a workload is distinct (each text, bio, review or question is used once), and the benchmark sends
each prompt at most once to a server: suffix decoding's cache of past answers may learn what answers of a kind look
like, never the answer to the very request it drafts for.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

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
NAMES += ["Hugo Silva", "Ines Novak", "Jonas Berg", "Kemi Adeyemi", "Lena Fischer", "Marco Rossi"]
CITIES = ["Lyon", "Lagos", "Chengdu", "Krakow", "Aarhus", "Beirut", "Pune", "Porto"]
JOBS = ["nurse", "software engineer", "baker", "teacher", "architect", "pilot", "journalist"]
HOBBIES = [("chess", "cycling"), ("painting", "hiking", "jazz"), ("gardening",), ("running", "photography")]
PRODUCTS = ["wireless headphones", "a French press", "a hiking backpack", "an e-reader", "a robot vacuum"]
PRODUCTS += ["a rice cooker", "a standing desk", "a smartwatch", "a tent", "an electric kettle", "a drone"]
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


# Open questions beyond QUESTIONS: each template over each topic, once.
TEMPLATES = [
    "Explain {} to a beginner.",
    "What are the pros and cons of {}?",
    "Give me three interesting facts about {}.",
    "Write a short paragraph about {}.",
    "How would you explain {} to a ten-year-old?",
    "What is the history of {}, in brief?",
    "What are common misconceptions about {}?",
    "Why does {} matter in everyday life?",
]
TOPICS = [
    "the water cycle",
    "compound interest",
    "black holes",
    "the immune system",
    "electric cars",
    "jazz music",
    "the printing press",
    "solar panels",
    "sourdough bread",
    "the stock market",
    "volcanoes",
    "honey bees",
    "the internet",
    "coffee",
    "the Roman Empire",
    "plate tectonics",
    "meditation",
    "3D printing",
    "tides",
    "the human heart",
    "recycling",
    "chess openings",
    "rainbows",
    "the moon landing",
    "vitamins",
    "wind turbines",
    "origami",
    "the Olympic Games",
    "coral reefs",
    "public libraries",
    "bicycles",
    "the periodic table",
    "migrating birds",
    "credit scores",
    "glaciers",
    "classical music",
    "the GPS system",
    "fermentation",
    "lighthouses",
    "the metric system",
    "sleep cycles",
    "bridges",
    "rain forests",
    "antibiotics",
    "typewriters",
    "the Silk Road",
    "hot air balloons",
    "composting",
    "earthworms",
    "the Fibonacci sequence",
]
# Where the edit texts come from: docstrings and functions of these standard-library modules.
EDIT_MODULES = [
    "json",
    "argparse",
    "collections",
    "functools",
    "textwrap",
    "shutil",
    "os",
    "pathlib",
    "re",
    "inspect",
    "typing",
    "subprocess",
    "threading",
    "logging",
    "datetime",
    "decimal",
    "fractions",
    "statistics",
    "random",
    "string",
    "csv",
    "zipfile",
    "tarfile",
    "pickle",
    "copy",
    "heapq",
    "bisect",
    "enum",
    "dataclasses",
    "contextlib",
    "tempfile",
    "glob",
    "fnmatch",
    "difflib",
    "unittest",
    "doctest",
    "pprint",
    "calendar",
    "configparser",
    "gettext",
    "locale",
    "socket",
    "selectors",
    "struct",
    "codecs",
    "base64",
    "hmac",
    "secrets",
    "uuid",
    "ipaddress",
    "urllib.parse",
    "http.client",
    "email.message",
    "email.utils",
    "asyncio.tasks",
    "asyncio.queues",
    "ast",
    "tokenize",
    "traceback",
    "warnings",
    "weakref",
    "abc",
    "numbers",
    "operator",
    "platform",
    "sysconfig",
    "zipapp",
    "imaplib",
    "smtplib",
    "ftplib",
    "mailbox",
    "xml.dom.minidom",
    "html.parser",
    "shlex",
    "cmd",
    "getopt",
    "optparse",
]
PROSE_TASKS = [
    "Rewrite the following text in plain English, keeping every detail:",
    "Summarise the following text:",
    "Fix any spelling or grammar mistakes in the following text and return it in full:",
]
CODE_TASKS = [
    "Add a comment above each line of this Python code and return the whole code:",
    "Rename the variables of this Python code to clearer names, return the code:",
]


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def edit_texts() -> tuple[list[str], list[str]]:
    """Distinct prose (docstrings of 300+ characters, cut at 1000) and code (functions of 300-1500 characters)."""
    prose: list[str] = []
    code: list[str] = []
    for name in EDIT_MODULES:
        with warnings.catch_warnings():  # importing or reading some (typing.io, ...) warns of deprecation
            warnings.simplefilter("ignore")
            prose_, code_ = _texts_of(name)
        prose += prose_
        code += code_
    return _unique(prose), _unique(code)


def _texts_of(name: str) -> tuple[list[str], list[str]]:
    """One module's long docstrings and mid-sized functions, in name order."""
    prose: list[str] = []
    code: list[str] = []
    try:
        module = importlib.import_module(name)
    except ImportError:
        return prose, code
    for _, obj in sorted(vars(module).items()):
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or getattr(obj, "__module__", None) != name:
            continue
        doc = inspect.getdoc(obj) or ""
        if len(doc) >= 300:
            prose.append(doc[:1000])
        if inspect.isfunction(obj):
            try:
                source = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if 300 <= len(source) <= 1500:
                code.append(source)
    return prose, code


def edit_prompts() -> list[str]:
    """Rewrite, summarise and correct prose; comment and rename code: five tasks in turn, each on a text of its own
    (no text is used twice)."""
    prose, code = edit_texts()
    rounds = min(len(prose) // len(PROSE_TASKS), len(code) // len(CODE_TASKS))
    prompts = []
    for r in range(rounds):
        for t, task in enumerate(PROSE_TASKS):
            prompts.append(f"{task}\n\n{prose[r * len(PROSE_TASKS) + t]}")
        for t, task in enumerate(CODE_TASKS):
            prompts.append(f"{task}\n\n{code[r * len(CODE_TASKS) + t]}")
    return prompts


def json_prompts() -> list[tuple[str, dict]]:
    """A bio, then a review, in turn: every bio a distinct (name, city, job, hobbies) and every review a distinct
    (product, liked, disliked, rating)."""
    bios: list[tuple[str, dict]] = []
    for i in range(len(NAMES) * len(CITIES) * len(JOBS)):
        name, city = NAMES[i % len(NAMES)], CITIES[(i // len(NAMES)) % len(CITIES)]
        job = JOBS[(i // (len(NAMES) * len(CITIES))) % len(JOBS)]
        hobbies = " and ".join(HOBBIES[i % len(HOBBIES)])
        bio = f"{name} is {21 + (i * 13) % 47} years old and lives in {city}, where they work as a {job}. "
        bio += f"In their free time they enjoy {hobbies}."
        bios.append((f"Extract the person's details from this bio as JSON.\n\nBio: {bio}", PERSON_SCHEMA))
    reviews: list[tuple[str, dict]] = []
    goods, bads = ("light", "battery life", "price", "design"), ("noise", "size", "weight")
    for i in range(len(PRODUCTS) * len(goods) * len(bads) * 5):
        product, good = PRODUCTS[i % len(PRODUCTS)], goods[(i // len(PRODUCTS)) % len(goods)]
        bad = bads[(i // (len(PRODUCTS) * len(goods))) % len(bads)]
        rating = 1 + (i // (len(PRODUCTS) * len(goods) * len(bads))) % 5
        review = f"I bought {product} last month. I love the {good}, but the {bad} disappoints me. "
        review += f"Overall I'd give it {rating} out of 5."
        reviews.append((f"Turn this review into JSON.\n\nReview: {review}", REVIEW_SCHEMA))
    return [p for pair in zip(bios, reviews, strict=False) for p in pair]


def chat_prompts() -> list[str]:
    """QUESTIONS, then each template over the topics (template after template, so that neighbours differ)."""
    asked = [template.format(topic) for topic in TOPICS for template in TEMPLATES]
    return _unique(QUESTIONS + asked)
