"""What the gRPC edge needs of an engine: the `Engine` protocol, and the records it answers with.

The real engine (async_engine.AsyncEngine) and the service tests' fake both satisfy it; the service and the
app depend on it, not on either. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from llmserve.engine.types.adapters import AdapterAnswer, AdapterOp
from llmserve.engine.types.kv_cache import KvEvent
from llmserve.engine.types.outputs import Delta
from llmserve.engine.types.request import GenerationRequest
from llmserve.engine.types.stats import LoraStats, SpecStats, TierStats


@dataclass(slots=True)
class ModelInfo:
    name: str
    context_length: int
    max_new_tokens: int
    dtype: str
    device: str
    vocab_size: int
    backend: str = ""  # which path serves, and how (the backend's name and one-line description)
    sliding_window: int = 0  # the model's attention window, 0 for none; the context is capped at it
    max_loras: int = 0  # LoRA adapters in one step (--max-loras); 0 when the server serves none
    max_lora_rank: int = 0
    eos_token_ids: tuple[int, ...] = ()  # the tokens that end a generation (unless a request ignores EOS)
    # What the model serves (GetModelInfo's tasks): "generate", "embed", "classify" (Embed returns a classifier's
    # logits); and Embed's defaults and limits, from the folder's sentence-transformers files or the classifier's
    # head (0 / "" when it serves no Embed).
    tasks: tuple[str, ...] = ("generate",)
    embedding_size: int = 0
    pooling: str = ""  # types/pooling.PoolingMode's value
    normalize: bool = False
    max_embed_input_tokens: int = 0
    do_lower_case: bool = False  # sentence-transformers lowercases texts before tokenizing
    labels: tuple[str, ...] = ()  # a classifier's class labels, in class order (id2label); () for any other model
    # Instruction prompts (config_sentence_transformers.json): (name, text) in the file's order, the default's name
    # ("" for none), and whether prompts are served at all (not where pooling leaves the prompt's tokens out).
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str = ""
    serves_prompts: bool = True


@dataclass(slots=True)
class SessionInfo:
    session_id: str
    cached_tokens: int  # tokens whose KV the pool holds
    last_used: float  # unix time
    tier_tokens: int = 0  # tokens whose KV a lower tier (host memory, disk) holds, past those in the pool


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's book-keeping, for metrics: gauges now, and counters since start."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int  # referenced by running sequences or sessions
    kv_blocks_cached: int  # unreferenced, kept for prefix reuse (allocatable)
    block_size: int
    sessions: int
    session_blocks: int
    preemptions: int
    session_hits: int
    session_misses: int
    session_evictions: dict[str, int]
    prefix_cache_hits: int
    kv_tiers: TierStats | None = None  # when tiers are on
    lora: LoraStats | None = None  # when the server serves LoRA adapters
    speculation: SpecStats | None = None  # when --speculative is on


class Tokenizer(Protocol):
    """What the gRPC edge uses of the model's tokenizer (a transformers tokenizer has it; the tests' fakes too)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, conversation: list[dict[str, str]], /, *, tokenize: bool, add_generation_prompt: bool
    ) -> object: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str] | str: ...


class Engine(Protocol):
    """An engine the service can serve from. `generate` raises InvalidRequest, EngineDead or QueueFull before
    its first delta; closing the stream early aborts the request."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...  # None for random-weight models

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def dead(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def engine_pid(self) -> int | None: ...  # the engine process's, when the core runs in one of its own

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def take_kv_events(self) -> list[KvEvent]: ...  # the prefix cache's stored/removed blocks since the last call

    async def get_session(self, session_id: str) -> SessionInfo | None: ...

    async def delete_session(self, session_id: str) -> bool: ...

    @property
    def adapters(self) -> AdapterAnswer | None: ...  # the LoRA adapters as last known; None when LoRA is off

    async def manage_adapters(self, op: AdapterOp) -> AdapterAnswer: ...  # AdapterService's load, unload, list

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]: ...
