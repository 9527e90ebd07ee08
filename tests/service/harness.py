"""Test harness for the service and client tests: a tiny random Llama with the real SmolLM2 tokenizer,
and an LLMServer running on its own event loop in a background thread, on a free loopback port.

Running the server on its own loop keeps it independent of the tests' event loops: tests talk to it
through real gRPC channels (sync, or asyncio in their own loop), exactly as a remote caller would.
"""

from __future__ import annotations

import functools
from typing import Any

import grpc
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from transformers import LlamaConfig

from llmserve.engine.config import EngineConfig
from llmserve.engine.types.model import LoadedModel
from llmserve.models.loader import from_config
from tests.forking_launcher import forking_launcher
from tests.testing import ServerThread

__all__ = ["ServerThread"]  # tests import it from here with the rest of the harness

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
    """The default model's real tokenizer, read from its converted folder (converted once and cached; the model's
    weights are not loaded)."""
    from transformers import AutoTokenizer

    from llmserve.models.gguf import convert_gguf, default_gguf_path

    return AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()), local_files_only=True)


def tiny_model(seed: int = 0) -> LoadedModel:
    """A tiny random-weight Llama (float32, CPU) that speaks the SmolLM2 vocabulary."""
    return from_config(LlamaConfig(**TINY_LLAMA), tokenizer=smollm2_tokenizer(), dtype=torch.float32, seed=seed)


def engine_config(**overrides: Any) -> EngineConfig:
    """The service tests' engine settings (a small pool and step budget, no CUDA graphs), with `overrides`."""
    settings: dict[str, Any] = dict(
        kv_cache_tokens=32768, max_num_seqs=16, max_num_batched_tokens=512, cuda_graphs=False
    )
    settings.update(overrides)
    return EngineConfig(**settings)


def tiny_engine(*, in_process: bool = False, **overrides: Any) -> Any:
    """A real AsyncEngine (not started) over tiny_model(): its core in an engine process of its own, as
    `python -m llmserve` runs it, or with `in_process` on a thread of this process (`--engine-in-process`), for the
    tests that reach into the core's books."""
    from llmserve.engine.core.process import ChildSpec, ProcessCore
    from llmserve.engine.frontend.async_engine import AsyncEngine

    config = engine_config(**overrides)
    if in_process:
        return AsyncEngine(tiny_model(), config)
    # The child imports this module by its name, `harness`; it is forked from this worker's preloaded interpreter.
    core = ProcessCore(ChildSpec(tiny_model, config), forking_launcher())
    core.wait_ready()
    assert core.card is not None
    return AsyncEngine(core.card, config, core=core)


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
