"""A stand-in for llmserve.engine.core.engine_core.AsyncEngine with the same interface and no model.

It lets the service tests force what the real engine rarely does on demand: a full queue, a dead engine,
a failed forward. Each request "generates" token ids prompt[-1]+1, +2, ... (mod vocab), one per step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from llmserve.engine.types.adapters import AdapterAnswer, AdapterOp
from llmserve.engine.types.errors import EngineDead, QueueFull
from llmserve.engine.types.kv_cache import KvEvent
from llmserve.engine.types.outputs import Delta, FinishReason, Timing, TokenLogprob, Usage
from llmserve.engine.types.protocol import Engine, EngineStats, ModelInfo, SessionInfo
from llmserve.engine.types.request import GenerationRequest


class FakeTokenizer:
    """Characters are tokens: id = code point (mod vocab); enough to exercise text and chat inputs."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, turns: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"<{t['role']}>{t['content']}" for t in turns) + "<assistant>"

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


class FakeEngine:
    """Knobs: `step_s` per token, `queue_full`, `dead_reason`, `fail_after` (tokens before an ERROR finish)."""

    def __init__(self, step_s: float = 0.005) -> None:
        self.step_s = step_s
        self.queue_full = False
        self.dead_reason: str | None = None
        self.fail_after: int | None = None
        self.tokenizer = FakeTokenizer()
        self.model_info = ModelInfo("fake", 256, 255, "float32", "cpu", 1000, backend="fake: no model")
        self.started = False
        self.adapters = None  # serves no LoRA adapters
        self.aborted: list[str] = []
        self._running: set[str] = set()
        self._sessions: dict[str, int] = {}

    @property
    def dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def engine_pid(self) -> int | None:
        return None

    @property
    def num_running(self) -> int:
        return len(self._running)

    num_waiting = 0

    async def manage_adapters(self, op: AdapterOp) -> AdapterAnswer:
        raise AssertionError("the fake engine serves no adapters (AdapterService answers FAILED_PRECONDITION first)")

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        running = len(self._running)
        return EngineStats(running, 0, 64, 0, 0, 16, len(self._sessions), 0, 0, 0, 0, {}, 0)

    def take_kv_events(self) -> list[KvEvent]:
        return []  # no prefix cache

    async def get_session(self, session_id: str) -> SessionInfo | None:
        if session_id not in self._sessions:
            return None
        return SessionInfo(session_id, self._sessions[session_id], time.time())

    async def delete_session(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        if self.dead:
            raise EngineDead(self.dead_reason)
        request.validate(self.model_info.vocab_size, self.model_info.context_length)
        if self.queue_full:
            raise QueueFull("fake queue is full")
        rid = request.request_id
        arrival = time.monotonic()
        self._running.add(rid)
        finished = False
        try:
            last = request.prompt_token_ids[-1]
            for i in range(1, request.stopping.max_new_tokens + 1):
                await asyncio.sleep(self.step_s)
                if request.deadline is not None and time.monotonic() >= request.deadline:
                    finished = True
                    yield self._final(request, FinishReason.DEADLINE, i - 1, arrival)
                    return
                token = (last + i) % self.model_info.vocab_size
                delta = Delta(rid, [token], chr(token))
                if request.logprobs:
                    top = [(token, -0.5), (token + 1, -1.5)][: request.top_logprobs]
                    delta.logprobs = [TokenLogprob(token, -0.5, top)]
                if self.fail_after is not None and i > self.fail_after:
                    finished = True
                    yield self._final(request, FinishReason.ERROR, i - 1, arrival, error="fake forward failed")
                    return
                if i == request.stopping.max_new_tokens:
                    finished = True
                    final = self._final(request, FinishReason.LENGTH, i, arrival)
                    delta.finish_reason, delta.usage, delta.timing = final.finish_reason, final.usage, final.timing
                    if request.session_id:
                        self._sessions[request.session_id] = len(request.prompt_token_ids) + i
                yield delta
        finally:
            self._running.discard(rid)
            if not finished:
                self.abort(rid)

    def _final(
        self, request: GenerationRequest, reason: FinishReason, n: int, arrival: float, error: str | None = None
    ) -> Delta:
        elapsed = time.monotonic() - arrival
        usage = Usage(len(request.prompt_token_ids), 0, n)
        return Delta(request.request_id, [], "", None, reason, usage, Timing(0.0, self.step_s, elapsed), None, error)


def _satisfies_the_protocol(fake: FakeEngine) -> Engine:
    return fake  # checked by mypy (make lint): the fake stands in for the engine wherever the service needs one
