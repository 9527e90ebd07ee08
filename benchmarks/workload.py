"""The benchmark's requests: an endless, fixed-seed stream of chat prompts of mixed lengths.

Request k depends only on (seed, k), so every system sees the same prompts in the same order, however
many it consumes. Prompts are token ids from the start: with a tokenizer they are random words inside the
model's chat template (a user turn plus the generation prompt); without one (random-weight models) they are
random ids. Lengths are log-uniform over [min_prompt, max_prompt], so short chats outnumber long ones, as in
real chat traffic, while every length band is represented.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

PLACEHOLDER = "\x00PROMPT\x00"


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """The shape of the workload; `seed` fixes every prompt."""

    seed: int = 0
    min_prompt: int = 32
    max_prompt: int = 1024
    max_new_tokens: int = 128


@dataclass(slots=True, frozen=True)
class BenchRequest:
    """One request: prompt ids and how many tokens to generate (EOS is ignored by every system)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int


class PromptMaker:
    """Builds prompt k of a workload; see the module docstring."""

    def __init__(self, spec: WorkloadSpec, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        if spec.min_prompt < 1 or spec.max_prompt < spec.min_prompt:
            raise ValueError(f"prompt lengths must satisfy 1 <= min <= max, got {spec.min_prompt}..{spec.max_prompt}")
        self.spec = spec
        self.prefix: list[int] = []
        self.suffix: list[int] = []
        if tokenizer is not None:
            self.prefix, self.suffix = chat_frame(tokenizer)
            self.words = word_ids(tokenizer)
        else:
            # Stay clear of the low ids, where tokenizers keep their special tokens.
            low = min(256, vocab_size // 2)
            self.words = list(range(low, vocab_size))

    def prompt_length(self, k: int) -> int:
        rng = random.Random(f"{self.spec.seed}/{k}/length")
        lo, hi = math.log(self.spec.min_prompt), math.log(self.spec.max_prompt + 1)
        return min(self.spec.max_prompt, int(math.exp(rng.uniform(lo, hi))))

    def request(self, k: int) -> BenchRequest:
        length = self.prompt_length(k)
        frame = len(self.prefix) + len(self.suffix)
        rng = random.Random(f"{self.spec.seed}/{k}/words")
        body = rng.choices(self.words, k=max(1, length - frame))
        ids = tuple(self.prefix + body + self.suffix)
        return BenchRequest(f"r{k}", ids, self.spec.max_new_tokens)


class RequestStream:
    """Hands out requests 0, 1, 2, ... of a workload to whichever client asks next."""

    def __init__(self, maker: PromptMaker, start: int = 0) -> None:
        self.maker = maker
        self.next_index = start

    def __iter__(self) -> Iterator[BenchRequest]:
        return self

    def __next__(self) -> BenchRequest:
        request = self.maker.request(self.next_index)
        self.next_index += 1
        return request


def chat_frame(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The token ids of the chat template before and after a user message (generation prompt included)."""
    if tokenizer.chat_template is None:
        return [], []
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True, tokenize=False
    )
    before, after = text.split(PLACEHOLDER)
    encode = tokenizer.encode
    return encode(before, add_special_tokens=False), encode(after, add_special_tokens=False)


def word_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of vocabulary entries that decode to a plain lowercase word with a leading space.

    Random sequences of these read as (meaningless) text, so the model sees ordinary tokens, not special ones.
    """
    special = set(tokenizer.all_special_ids)
    words = []
    for token_id in range(len(tokenizer)):
        if token_id in special:
            continue
        text = tokenizer.decode([token_id])
        if len(text) >= 3 and text[0] == " " and text[1:].isalpha() and text[1:].islower():
            words.append(token_id)
    if len(words) < 100:
        raise ValueError(f"tokenizer has only {len(words)} plain word tokens; cannot build prompts")
    return words
