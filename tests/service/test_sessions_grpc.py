"""Session reuse seen through gRPC: turn 2 of a conversation reuses turn 1's prompt and answer."""

from __future__ import annotations

import pytest
from harness import ServerThread, tiny_engine

from llmserve.engine.config import EngineConfig
from llmserve.models.loader import load_model
from llmserve_client import Client


def test_turn_two_reports_cached_prompt_tokens_for_turn_one() -> None:
    srv = ServerThread(tiny_engine()).start()
    try:
        with Client(srv.address, timeout=60) as client:
            prompt = list(range(100, 180))
            first = list(
                client.generate(
                    token_ids=prompt, max_new_tokens=24, ignore_eos=True, session_id="conv", return_token_ids=True
                )
            )
            answer = [t for r in first for t in r.token_ids]
            assert first[-1].HasField("usage")
            usage1 = first[-1].usage
            assert (usage1.prompt_tokens, usage1.cached_prompt_tokens, usage1.completion_tokens) == (80, 0, 24)
            assert len(answer) == 24
            second = prompt + answer + [7, 8, 9]
            last = list(client.generate(token_ids=second, max_new_tokens=4, ignore_eos=True, session_id="conv"))[-1]
            assert last.HasField("usage") and last.usage.prompt_tokens == len(second)
            # Turn one's prompt and all but its last answer token (whose KV was never computed) are reused.
            assert last.usage.cached_prompt_tokens >= 0.95 * (80 + 24)
            # Another caller's session id shares nothing with this one.
            other = list(client.generate(token_ids=second, max_new_tokens=4, ignore_eos=True, session_id="other"))
            assert other[-1].usage.cached_prompt_tokens <= last.usage.cached_prompt_tokens
    finally:
        srv.stop()


@pytest.mark.real_model
def test_real_model_chat_turn_two_reuses_the_conversation() -> None:
    from llmserve.engine.frontend.async_engine import AsyncEngine

    engine = AsyncEngine(load_model(), EngineConfig(kv_cache_tokens=8192, max_num_seqs=4, cuda_graphs=False))
    srv = ServerThread(engine).start()
    try:
        with Client(srv.address, timeout=120) as client:
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            first = list(client.generate(messages=messages, max_new_tokens=48, session_id="chat"))
            answer = "".join(r.text for r in first)
            usage1 = first[-1].usage
            assert first[-1].HasField("usage") and usage1.prompt_tokens > 0 and usage1.completion_tokens > 0
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
            second = list(client.generate(messages=messages, max_new_tokens=24, session_id="chat"))
            cached = second[-1].usage.cached_prompt_tokens
            assert cached >= 0.95 * (usage1.prompt_tokens + usage1.completion_tokens), (cached, usage1)
    finally:
        srv.stop()


def test_get_session_reports_tokens_in_the_pool_and_in_the_disk_tier_apart(tmp_path) -> None:  # noqa: ANN001
    """A session the small pool evicted is still reported, its KV counted in the tier, and its next turn reloads."""
    engine = tiny_engine(kv_cache_tokens=20 * 16, session_pool_fraction=0.5, kv_offload_dir=str(tmp_path))
    srv = ServerThread(engine).start()
    try:
        with Client(srv.address, timeout=60) as client:
            prompts = {s: list(range(100 + 200 * i, 244 + 200 * i)) for i, s in enumerate("ABC")}
            answers = {}
            for s, prompt in prompts.items():
                out = list(
                    client.generate(
                        token_ids=prompt, max_new_tokens=8, ignore_eos=True, session_id=s, return_token_ids=True
                    )
                )
                answers[s] = [t for r in out for t in r.token_ids]
            held = client.get_session("C")
            assert held is not None and held.cached_tokens == 144 + 7 and held.tier_cached_tokens == 0
            gone = client.get_session("A")
            assert gone is not None and gone.tier_cached_tokens >= 8 * 16
            assert gone.cached_tokens + gone.tier_cached_tokens <= 144 + 7
            second = prompts["A"] + answers["A"] + [5]
            last = list(client.generate(token_ids=second, max_new_tokens=2, ignore_eos=True, session_id="A"))[-1]
            assert last.usage.cached_prompt_tokens >= gone.cached_tokens + gone.tier_cached_tokens
    finally:
        srv.stop()


def test_a_conversation_returning_after_a_server_restart_reloads_its_kv_from_disk(tmp_path) -> None:  # noqa: ANN001
    prompt = list(range(300, 460))
    tokens = {}
    for life in ("before", "after"):
        srv = ServerThread(tiny_engine(kv_offload_dir=str(tmp_path))).start()
        try:
            with Client(srv.address, timeout=60) as client:
                ask = prompt if life == "before" else prompt + tokens["before"] + [9]
                out = list(
                    client.generate(
                        token_ids=ask, max_new_tokens=4, ignore_eos=True, session_id="c", return_token_ids=True
                    )
                )
                tokens[life] = [t for r in out for t in r.token_ids]
                cached = out[-1].usage.cached_prompt_tokens
        finally:
            srv.stop()  # the shutdown writes the pool's blocks to the disk tier
    assert cached >= 160  # the new server's first call found the old server's KV on disk
