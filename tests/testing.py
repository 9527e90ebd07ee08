"""Tiny random-weight model configs for the tests and the benchmarks' probes (two layers, grouped-query attention
where the family has it), transformers' own greedy generation as the reference the engine is held to, and a
whole server on a loopback port in a thread of its own (`ServerThread`).

Shared by tests/ and benchmarks/ (whose probes import it from here): test code, not part of the shipped package."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import (
    BertConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from llmserve.app import LLMServer
from llmserve.config import ServerConfig
from llmserve.engine.backends.attention import KernelDecodeAttention
from llmserve.engine.types.model import LoadedModel
from llmserve.models.loader import from_config
from tests.ports import free_port

if TYPE_CHECKING:
    from llmserve.engine.backends.cpu.backend import CpuBackend
    from llmserve.engine.types.protocol import Engine

T = TypeVar("T")

TINY_VOCAB = 512


def tiny_config(
    family: str = "llama", vocab_size: int = TINY_VOCAB, max_positions: int = 2048, **overrides: Any
) -> PretrainedConfig:
    """A two-layer model of the given family (llama, mistral, qwen2, qwen3, gpt2, bert) with grouped-query attention
    where the family has it; `overrides` are
    the config's own arguments (id2label for a classifier, a sliding window, pad_token_id None), over these."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        return LlamaConfig(**common | overrides)
    if family == "mistral":
        return MistralConfig(**common | {"sliding_window": None} | overrides)
    if family == "qwen2":
        return Qwen2Config(**common | overrides)
    if family == "qwen3":
        return Qwen3Config(**common | {"head_dim": 16} | overrides)
    if family == "gpt2":
        gpt2: dict[str, Any] = dict(
            n_embd=64, n_layer=2, n_head=4, n_positions=max_positions, bos_token_id=1, eos_token_id=2
        )
        return GPT2Config(vocab_size=vocab_size, **gpt2 | overrides)
    if family == "bert":  # an encoder (the embedding and classification tests'): BERT's own ids and heads
        bert: dict[str, Any] = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=max_positions,
        )
        return BertConfig(vocab_size=vocab_size, **bert | overrides)
    raise ValueError(family)


def tiny_model(family: str = "llama", vocab_size: int = TINY_VOCAB, max_positions: int = 2048) -> LoadedModel:
    """A float32 tiny model on the CPU, random weights from seed 0 (a module-level function, so that a
    functools.partial of it builds the same model in an engine process: core/process.ChildSpec.load)."""
    return from_config(tiny_config(family, vocab_size, max_positions), dtype=torch.float32)


def greedy_reference(model: Any, prompt: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generation, one prompt alone, exactly `max_new` tokens."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # never infer a mask from a pad id that may occur in the prompt
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


PORT_TRIES = 5  # metrics ports tried before giving up


class ServerThread:
    """An LLMServer on 127.0.0.1:<free port>, with its own event loop on a daemon thread. With `metrics`, /metrics on
    a free port of its own too (`metrics_port`), another one tried where a socket took the first before the server
    bound it."""

    def __init__(self, engine: Engine, *, metrics: bool = False, **config: Any) -> None:
        self.engine = engine
        self.metrics = metrics
        self.config = ServerConfig(address="127.0.0.1:0", **config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.server: LLMServer | None = None

    @property
    def metrics_port(self) -> int:
        return self.config.metrics_port

    def start(self, *, serve: bool = True) -> ServerThread:
        """Bind and start; with `serve`, also start the engine and report SERVING."""
        self._thread.start()
        for attempt in range(PORT_TRIES):
            if self.metrics:
                self.config = dataclasses.replace(self.config, metrics_port=free_port())
            self.server = self.run(self._create())
            try:
                self.run(self.server.start())
                break
            except OSError as exc:
                if not self.metrics or exc.errno != errno.EADDRINUSE or attempt == PORT_TRIES - 1:
                    raise
                self.run(self.server.stop(0.0))
        if serve:
            self.serve()
        return self

    def serve(self) -> None:
        assert self.server is not None, "start() first"
        self.run(self.server.serve(self.engine))

    async def _create(self) -> LLMServer:
        return LLMServer(self.config)

    @property
    def address(self) -> str:
        assert self.server is not None, "start() first"
        return f"127.0.0.1:{self.server.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 0.0) -> None:
        if self.server is not None:
            self.run(self.server.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


def mend_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(array), which NumPy 2.4 refuses for the
    one-element arrays its scalars are; a loop bound read from memory (a sequence's length) needs it. For the CPU
    runs of the varlen kernel through the interpreter (TRITON_INTERPRET=1): the engine tests, gpu.sh --dry-run."""
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    patch = interpreter._patch_lang_tensor

    def patch_with_scalar_index(tensor: Any, scope: Any) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_scalar_index


def one_prompt_attention(backend: CpuBackend, tokens: int) -> KernelDecodeAttention:
    """The attention of one prompt of `tokens` tokens in blocks 0.. of `backend`'s KV cache, every token a query of
    the CPU decode kernel over the context up to itself: how the bfloat16, int8 and GGUF-block paths attend a prompt
    (the tests' and probes' way to run a whole prompt through `backend.forward` without a scheduler)."""
    assert backend.kernel is not None, "the CPU backend without its decode kernel"
    blocks = -(-tokens // backend.block_size)
    return KernelDecodeAttention(
        kv=backend.kv.tensor,
        slot_mapping=torch.arange(tokens),
        kernel=backend.kernel,
        num=tokens,
        tables=torch.arange(blocks, dtype=torch.int32).repeat(tokens, 1),
        lens=torch.arange(1, tokens + 1, dtype=torch.int32),
        max_len=tokens,
        block_size=backend.block_size,
        chunks=[],
    )
