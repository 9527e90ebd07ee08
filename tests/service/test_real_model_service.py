"""The default model (SmolLM2-135M-Instruct) behind the real server: a chat answer streams and is right."""

from __future__ import annotations

import pytest
from harness import ServerThread

from llmserve.engine.config import EngineConfig
from llmserve.models.loader import load_model
from llmserve_client import Client, pb

pytestmark = [pytest.mark.real_model]


def test_chat_capital_of_france_streams_paris() -> None:
    from llmserve.engine.frontend.async_engine import AsyncEngine

    # What `make run` serves: the shipped Q4_1 file from its own blocks with float activations (the default), which
    # answers as the float32 weights do. With --gguf-activations int8 it answers "L'Étoile, la Marseillaise, ...",
    # token for token what llama.cpp's llama-server answers on the same file (its best two first tokens are 0.24
    # apart; int8 activations as llama.cpp quantizes them).
    loaded = load_model()
    assert (loaded.weights, loaded.activations) == ("gguf", "float32")
    engine = AsyncEngine(loaded, EngineConfig(kv_cache_tokens=4096, max_num_seqs=4, cuda_graphs=False))
    srv = ServerThread(engine).start()
    try:
        with Client(srv.address, timeout=120) as client:
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            responses = list(client.generate(messages=messages, max_new_tokens=32))
    finally:
        srv.stop()
    answer = "".join(r.text for r in responses)
    assert len(responses) >= 2, "the answer streams"
    assert responses[-1].finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
    assert "Paris" in answer, answer
