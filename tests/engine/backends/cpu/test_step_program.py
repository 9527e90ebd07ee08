"""A whole step over a GGUF's blocks in one C call (step_program.py, csrc/forward.c) computes what the fused
forward's Python loop computes, bit for bit: the same tokens and logprobs, alone and batched with chunked prompts
beside decodes, and the same KV cache, for both activation schemes, mixed block types (a q/k/v linear of two
parts), Qwen3's per-head norms and the LM head over a subset of rows."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import inner, token_logprobs
from tests.gguf_helpers import Q, gguf_loaded, write_llama_gguf
from tests.testing import TINY_VOCAB, tiny_config


def model(tmp_path: Path, family: str, activations: str) -> Any:
    config = tiny_config(family)
    source = from_config(config, dtype=torch.float32, seed=4).model
    kinds = {"blk.0.attn_v.weight": Q.Q4_1, "blk.1.ffn_down.weight": Q.Q4_0}  # q/k/v in two parts in layer 0
    extra = {}
    if family == "qwen3":  # its per-head q/k norms, as llama.cpp names them
        state = source.state_dict()
        for i in range(config.num_hidden_layers):
            for ours, theirs in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
                w = state[f"model.layers.{i}.self_attn.{ours}.weight"].float().numpy()
                extra[f"blk.{i}.{theirs}.weight"] = (Q.F32, np.ascontiguousarray(w).view(np.uint8))
    path = write_llama_gguf(tmp_path / f"{family}.gguf", source, kinds, extra=extra, arch=family)
    return gguf_loaded(path, config, activations=activations)


@pytest.mark.parametrize(
    ("family", "activations"), [("llama", "int8"), ("llama", "float32"), ("qwen3", "float32"), ("qwen3", "int8")]
)
async def test_compiled_steps_equal_the_python_loop_bit_for_bit(tmp_path: Path, family: str, activations: str) -> None:
    loaded = model(tmp_path, family, activations)
    rng = random.Random(7)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (9, 70, 33, 1, 120)]
    requests = [
        GenerationRequest(f"r{i}", tuple(p), stopping=StoppingParams(10, ignore_eos=True), logprobs=True)
        for i, p in enumerate(prompts)
    ]
    results, caches, programs = [], [], []
    for compiled in (False, True):
        config = EngineConfig(kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=32, compiled_steps=compiled)
        engine = AsyncEngine(loaded, config)
        await engine.start()
        try:
            backend = inner(engine).backend
            runs = []
            if compiled:
                assert backend.program is not None
                run = backend.program.run
                backend.program.run = lambda *a, run=run, runs=runs: runs.append(1) or run(*a)  # type: ignore[method-assign]
            else:
                assert backend.program is None
            alone = await token_logprobs(engine, requests, together=False)
            caches.append(backend.kv.tensor.clone())
            together = await token_logprobs(engine, requests, together=True)  # prompts in chunks of 32 beside decodes
            results.append((alone, together))
            programs.append(len(runs))
        finally:
            await engine.shutdown()
    assert results[1] == results[0]
    assert all(len(r) == 10 for r in results[0][0])
    assert torch.equal(caches[1], caches[0])
    assert programs[1] >= 2 * 9  # the decode steps of the requests alone, at least, ran as one call each
