"""Conversations at the token level, and one timed call on the in-process engine: the workload of the sessions,
append-mode and KV-tier modes.

The next turn's prompt is the previous prompt, the answer's token ids and the template's tokens for "end of
answer, next user message, generation prompt", so a reused session matches up to the new message.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from benchmarks.settings import BenchSettings, EngineSettings
from benchmarks.workload import PLACEHOLDER, chat_frame, word_ids
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import GenerationRequest, StoppingParams

SECOND = "\x00SECOND\x00"
T = TypeVar("T")


@dataclass(slots=True)
class Turn:
    """One call's outcome."""

    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    output_ids: list[int]


@dataclass(slots=True, frozen=True)
class SessionsSpec:
    """Sizes of a conversations workload (the sessions and append modes); lengths are in tokens."""

    history_tokens: int = 2000
    history_reps: int = 3
    sessions: int = 32
    turns: int = 6
    first_message: tuple[int, int] = (32, 96)
    follow_up: int = 32
    answer: int = 32
    seed: int = 0


FULL = SessionsSpec()
QUICK = SessionsSpec(history_tokens=300, history_reps=1, sessions=4, turns=3, first_message=(16, 32), answer=8)


class ChatBuilder:
    """Token-level chat turns of random words in the model's chat template (random ids without a tokenizer)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, seed: int) -> None:
        self.seed = seed
        self.open_prefix: list[int] = []
        self.open_suffix: list[int] = []
        self.next_prefix: list[int] = []
        self.next_suffix: list[int] = []
        if tokenizer is None:
            self.words = list(range(min(256, vocab_size // 2), vocab_size))
            return
        self.words = word_ids(tokenizer)
        self.open_prefix, self.open_suffix = chat_frame(tokenizer)
        if tokenizer.chat_template is not None:
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": PLACEHOLDER},
                {"role": "user", "content": SECOND},
            ]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            between, after = text.split(PLACEHOLDER)[1].split(SECOND)
            self.next_prefix = tokenizer.encode(between, add_special_tokens=False)
            self.next_suffix = tokenizer.encode(after, add_special_tokens=False)

    def _words(self, key: str, n: int) -> list[int]:
        return random.Random(f"{self.seed}/{key}").choices(self.words, k=max(1, n))

    def opening(self, key: str, n: int) -> list[int]:
        """A first user message of about n tokens, ready for the answer."""
        return self.open_prefix + self._words(key, n - len(self.open_prefix) - len(self.open_suffix)) + self.open_suffix

    def follow_up(self, key: str, n: int) -> list[int]:
        """Closes the answer, adds a user message of about n tokens and the generation prompt."""
        return self.next_prefix + self._words(key, n - len(self.next_prefix) - len(self.next_suffix)) + self.next_suffix

    def history(self, key: str, n: int) -> list[int]:
        """A multi-turn conversation of at least n tokens ending with the generation prompt."""
        ids = self.opening(f"{key}/0", 200)
        turn = 0
        while len(ids) < n:
            turn += 1
            ids += self._words(f"{key}/answer{turn}", 150) + self.follow_up(f"{key}/{turn}", 100)
        return ids


def sized_engine(engine: EngineSettings, spec: SessionsSpec) -> EngineSettings:
    """Room for every session's longest turn twice over (running plus retained), and for the long history."""
    longest = spec.first_message[1] + spec.turns * (spec.answer + spec.follow_up + 32)
    tokens = max(engine.kv_cache_tokens, 2 * spec.sessions * longest, 4 * (spec.history_tokens + 512))
    return replace(engine, kv_cache_tokens=tokens, max_num_seqs=max(engine.max_num_seqs, spec.sessions))


def engine_config(settings: BenchSettings, reuse: bool) -> EngineConfig:
    e = settings.engine
    return EngineConfig(
        block_size=e.block_size,
        kv_cache_tokens=e.kv_cache_tokens,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        enable_prefix_caching=reuse,
    )


async def call(engine: AsyncEngine, rid: str, prompt: list[int], new: int, session: str | None) -> Turn:
    """One greedy call generating exactly `new` tokens; returns its timings and token ids."""
    request = GenerationRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        stopping=StoppingParams(max_new_tokens=new, ignore_eos=True),
        session_id=session,
    )
    start = time.perf_counter()
    first = None
    ids: list[int] = []
    cached = 0
    async for delta in engine.generate(request):
        if delta.token_ids and first is None:
            first = time.perf_counter()
        ids += delta.token_ids
        if delta.usage is not None:
            cached = delta.usage.cached_prompt_tokens
        if delta.finished and delta.error:
            raise RuntimeError(f"{rid}: {delta.finish_reason.value}: {delta.error}")
    end = time.perf_counter()
    return Turn((first or end) - start, end - start, len(prompt), cached, ids)


async def with_engine(loaded: LoadedModel, config: EngineConfig, body: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """`body` on a started in-process engine, shut down after it."""
    engine = AsyncEngine(loaded, config)
    await engine.start()
    try:
        return await body(engine)
    finally:
        await engine.shutdown()
