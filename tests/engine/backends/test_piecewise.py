"""The mixed-steps candidate (backends/piecewise.py) on the CPU emulation: the CUDA backend (capture=False, the
varlen kernel through Triton's interpreter) with `--mixed-steps compile` and `compile-graphs` serves every step
that mixes prompt chunks with decodes through torch.compile, broken at each layer's attention, and its greedy
output equals `generate` in float64.

In the suite the compiler is aot_eager (Dynamo's graph breaks and the traced pieces, without inductor's code
generation: seconds instead of a minute on two cores); LLMSERVE_LONG_TESTS=1 runs inductor too."""

from __future__ import annotations

import asyncio
import functools
import os

import pytest
import torch

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.cuda import CudaBackend
from llmserve.engine.backends.paged import TransformersForward
from llmserve.engine.backends.piecewise import MixedSteps, token_bucket
from llmserve.engine.config import EngineConfig
from llmserve.engine.frontend.async_engine import AsyncEngine
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config
from tests.testing import greedy_reference, tiny_config

pytest.importorskip("triton", reason="the CUDA backend is built on the Triton varlen kernel")

COMPILERS = ["aot_eager"] + (["inductor"] if os.environ.get("LLMSERVE_LONG_TESTS") else [])


def test_token_buckets() -> None:
    assert [token_bucket(n, 512) for n in (1, 16, 17, 33, 300, 512)] == [16, 16, 32, 64, 512, 512]
    assert token_bucket(40, 48) == 48  # never past what the buffers hold


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="compile, compile-graphs"):
        MixedSteps(lambda *a: torch.zeros(0), None, "fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("mode", ["compile", "compile-graphs"])
async def test_mixed_steps_compiled_equal_generate(mode: str, compiler: str) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    loaded = from_config(tiny_config(max_positions=256), dtype=torch.float64)
    prompts = [list(range(1, 40)), list(range(5, 70)), list(range(9, 30))]
    lengths = [6, 4, 8]
    expected = [greedy_reference(loaded.model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    config = EngineConfig(
        block_size=16,
        kv_cache_tokens=2048,
        max_num_seqs=4,
        max_num_batched_tokens=32,  # prompts in chunks, beside the others' decodes
        attention_kernel="triton",
        mixed_steps=mode,
    )
    engine = AsyncEngine(loaded, config)
    backend = create_backend(loaded, config, engine.core.engine_core.max_model_len, kind="cuda", capture=False)
    assert isinstance(backend, CudaBackend) and backend.mixed is not None and backend.mixed.mode == mode
    assert f"torch.compile ({mode})" in backend.description
    forward = functools.partial(TransformersForward.logits, backend.forward)
    backend.mixed = mixed = MixedSteps(forward, backend.graphs.steps, mode, compiler=compiler)
    padded: list[int] = []
    real_write = backend.graphs.steps.write

    def write(entries, *, rows_to=None, tokens_to=None):  # noqa: ANN001, ANN202
        if rows_to is None:
            padded.append(tokens_to)
        return real_write(entries, rows_to=rows_to, tokens_to=tokens_to)

    backend.graphs.steps.write = write  # type: ignore[method-assign]
    engine.core.engine_core.backend = backend
    torch._dynamo.utils.counters.clear()
    await engine.start()
    try:

        async def one(i: int) -> list[int]:
            stopping = StoppingParams(lengths[i], ignore_eos=True)
            request = GenerationRequest(f"r{i}", tuple(prompts[i]), stopping=stopping)
            return [t async for d in engine.generate(request) for t in d.token_ids]

        async with asyncio.timeout(300):
            outputs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await engine.shutdown()
    assert outputs == expected
    assert mixed.runs > 0 and backend.graphs.replays > 0  # mixed steps compiled, decode-only steps from buckets
    # The graph broke at each layer's attention (2 layers: 3 pieces at least), never traced through it.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3
    if mode == "compile-graphs":
        assert padded and all(t is not None and t in (16, 32) for t in padded)
    else:
        assert padded and all(t is None for t in padded)
