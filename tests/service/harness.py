"""Test harness for the service and client tests: a tiny random Llama with the real SmolLM2 tokenizer,
and an LLMServer running on its own event loop in a background thread, on a free loopback port.

Running the server on its own loop keeps it independent of the tests' event loops: tests talk to it
through real gRPC channels (sync, or asyncio in their own loop), exactly as a remote caller would.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from transformers import LlamaConfig

from llmserve.app import LLMServer
from llmserve.config import ServerConfig
from llmserve.engine.config import EngineConfig
from llmserve.models import LoadedModel, from_config, load_model

T = TypeVar("T")

CONTEXT_LENGTH = 1024
TINY_LLAMA = dict(
    vocab_size=49152,  # the SmolLM2 tokenizer's
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=CONTEXT_LENGTH,
    bos_token_id=1,
    eos_token_id=2,
)


@functools.cache
def smollm2_tokenizer() -> Any:
    """The default model's real tokenizer (the model is converted once and cached by load_model)."""
    return load_model().tokenizer


def tiny_model(seed: int = 0) -> LoadedModel:
    """A tiny random-weight Llama (float32, CPU) that speaks the SmolLM2 vocabulary."""
    return from_config(LlamaConfig(**TINY_LLAMA), tokenizer=smollm2_tokenizer(), dtype=torch.float32, seed=seed)


def tiny_engine(**overrides: Any) -> Any:
    """A real AsyncEngine (not started) over tiny_model()."""
    from llmserve.engine.async_engine import AsyncEngine

    settings = dict(kv_cache_tokens=32768, max_num_seqs=16, max_num_batched_tokens=512, cuda_graphs=False)
    settings.update(overrides)
    return AsyncEngine(tiny_model(), EngineConfig(**settings))


class ServerThread:
    """An LLMServer on 127.0.0.1:<free port>, with its own event loop on a daemon thread."""

    def __init__(self, engine: Any, **config: Any) -> None:
        self.engine = engine
        self.config = ServerConfig(address="127.0.0.1:0", **config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.server: LLMServer | None = None

    def start(self, *, serve: bool = True) -> ServerThread:
        """Bind and start; with `serve`, also start the engine and report SERVING."""
        self._thread.start()
        self.server = self.run(self._create())
        self.run(self.server.start())
        if serve:
            self.serve()
        return self

    def serve(self) -> None:
        self.run(self.server.serve(self.engine))

    async def _create(self) -> LLMServer:
        return LLMServer(self.config)

    @property
    def address(self) -> str:
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


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll `predicate` until it is true or `timeout` passes; return its last value."""
    import time

    end = time.monotonic() + timeout
    while not (ok := predicate()) and time.monotonic() < end:
        time.sleep(interval)
    return bool(ok)


def bad_request_fields(err: grpc.RpcError) -> list[str]:
    """The fields of the google.rpc.BadRequest field violations in a failed call's rich status."""
    fields: list[str] = []
    status = rpc_status.from_call(err)
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields
