"""The CPU backend over a GGUF's blocks (`--dtype gguf`): its description; bitwise batch invariance (a token's
logprob is the same whether its prompt was computed in one chunk or in many beside other requests': every token's
attention through the decode kernel, the kernels give a row the same bits whatever the other rows); and with float32
activations, the float32 path's greedy tokens."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config, load_model
from tests.engine.engine_helpers import inner, token_logprobs
from tests.gguf_helpers import Q, gguf_loaded, write_llama_gguf
from tests.testing import TINY_VOCAB, tiny_config


def tiny(tmp_path: Path, activations: str = "float32"):  # noqa: ANN201 - a LoadedModel over a GGUF's blocks
    config = tiny_config("llama")
    source = from_config(config, dtype=torch.float32, seed=9).model
    kinds = {"blk.0.attn_v.weight": Q.Q4_1, "blk.1.ffn_down.weight": Q.Q4_0}  # mixed types, as Q4_K_M files are
    return gguf_loaded(write_llama_gguf(tmp_path / "tiny.gguf", source, kinds), config, activations=activations)


@pytest.mark.parametrize("activations", ["float32", "int8"])
async def test_logprobs_are_bitwise_the_same_alone_and_chunked_among_others(tmp_path: Path, activations: str) -> None:
    """Both activation schemes attend every token through the decode kernel: a token's logprob is the same bits
    whatever chunk computed its prompt and whatever ran beside it."""
    loaded = tiny(tmp_path, activations)
    rng = random.Random(2)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (61, 130, 97, 5, 44, 118)]
    requests = [
        GenerationRequest(f"r{i}", tuple(p), stopping=StoppingParams(12, ignore_eos=True), logprobs=True)
        for i, p in enumerate(prompts)
    ]
    results = []
    for config, together in (
        (EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=1024, enable_prefix_caching=False), False),
        (EngineConfig(kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=16), True),  # chunks of <= 16
    ):
        engine = AsyncEngine(loaded, config)
        await engine.start()
        try:
            backend = inner(engine).backend
            linears = "gguf-float32" if activations == "float32" else "gguf"
            assert backend.fused is not None and backend.fused.precision.linears == linears
            results.append(await token_logprobs(engine, requests, together))
        finally:
            await engine.shutdown()
    alone, together_ = results
    assert all(len(r) == 12 for r in alone)
    assert together_ == alone


@pytest.mark.parametrize(("activations", "linears"), [("float32", "gguf-float32"), ("int8", "gguf")])
def test_the_description_names_the_block_types_and_the_kernels(tmp_path: Path, activations: str, linears: str) -> None:
    from llmserve.engine.backends import create_backend
    from llmserve.engine.backends.cpu import quant

    backend = create_backend(tiny(tmp_path, activations), EngineConfig(kv_cache_tokens=1024))
    text = backend.description
    assert f"fused Llama-family forward ({linears}, float32 residual)" in text
    assert "for every token" in text
    # 2 layers x (qkv, o, gate_up, down) + the tied head: layer 0's qkv is two kernels (Q8_0 q/k, Q4_1 v).
    kinds = f"8 Q8_0, 1 Q4_1, 1 Q4_0; {quant.kernel_level()} kernels, {activations} activations"
    assert f"linears from the GGUF's blocks ({kinds})" in text


QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "What is 17 times 23?",
    "Describe the water cycle.",
)


@pytest.mark.real_model
async def test_float_activations_give_the_float32_paths_greedy_tokens_under_batching_and_preemption(
    tmp_path: Path,
) -> None:
    """Fidelity: with float32 activations the blocks compute the dequantized weights' products up to float32
    rounding, so the default model's greedy tokens equal the float32 path's (the file dequantized), each prompt
    alone there, here all at once in chunks of 48 tokens in a pool that preempts. (With `--gguf-activations int8`
    1 of 16 chat prompts stays identical for 64 tokens: docs/cpu-dtypes.md.)"""
    dense = load_model(None, device="cpu", dtype="float32")
    tok = dense.tokenizer
    prompts = [
        list(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        for q in QUESTIONS
    ]
    requests = [GenerationRequest(f"q{i}", tuple(p), stopping=StoppingParams(32, ignore_eos=True)) for i, p in
                enumerate(prompts)]  # fmt: skip

    async def tokens(engine: AsyncEngine, request: GenerationRequest) -> list[int]:
        out: list[int] = []
        async for delta in engine.generate(request):
            out += delta.token_ids
        return out

    engine = AsyncEngine(dense, EngineConfig(kv_cache_tokens=4096, max_num_seqs=8))
    await engine.start()
    try:
        expected = [await asyncio.wait_for(tokens(engine, r), 120) for r in requests]
    finally:
        await engine.shutdown()
    blocks = load_model(None, device="cpu", dtype="gguf", gguf_activations="float32", cache_root=tmp_path)
    busy = EngineConfig(kv_cache_tokens=320, max_num_seqs=8, max_num_batched_tokens=48)
    engine = AsyncEngine(blocks, busy)
    await engine.start()
    try:
        assert inner(engine).backend.fused.precision.linears == "gguf-float32"
        got = await asyncio.wait_for(asyncio.gather(*(tokens(engine, r) for r in requests)), 300)
        preempted = inner(engine).scheduler.num_preemptions
    finally:
        await engine.shutdown()
    assert list(got) == expected
    assert preempted > 0
