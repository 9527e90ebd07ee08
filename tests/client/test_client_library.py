"""llmserve_client.Client and AsyncClient against a real in-process server."""

from __future__ import annotations

import grpc
import pytest
from harness import ServerThread, smollm2_tokenizer, wait_until

from llmserve_client import TLS, AsyncClient, Client, build_request, pb

PROMPT = "Once upon a time, in a land far away,"


def test_generate_streams_and_generate_text_joins(server: ServerThread) -> None:
    with Client(server.address, timeout=30) as client:
        responses = list(client.generate(PROMPT, max_new_tokens=12, ignore_eos=True, return_token_ids=True))
        assert len(responses) >= 2
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        text = "".join(r.text for r in responses)
        assert text == smollm2_tokenizer().decode([t for r in responses for t in r.token_ids])
        assert client.generate_text(PROMPT, max_new_tokens=12, ignore_eos=True) == text
        request = build_request(PROMPT, max_new_tokens=12, ignore_eos=True)
        assert client.generate_text(request) == text


def test_prompt_logprobs_come_on_the_first_response(server: ServerThread) -> None:
    with Client(server.address, timeout=30) as client:
        ids = client.tokenize(PROMPT)
        responses = list(client.generate(PROMPT, max_new_tokens=2, prompt_top_logprobs=2))
        scores = responses[0].prompt_logprobs
        assert [lp.token_id for lp in scores] == ids[1:] and all(len(lp.top_logprobs) == 2 for lp in scores)
        assert not any(r.prompt_logprobs for r in responses[1:])
        only = list(client.generate(PROMPT, max_new_tokens=1, prompt_logprobs=True))[0].prompt_logprobs
        assert [lp.logprob for lp in only] == [lp.logprob for lp in scores] and not only[0].top_logprobs


def test_unary_helpers(server: ServerThread) -> None:
    with Client(server.address, timeout=30) as client:
        assert client.health() == "SERVING"
        assert client.health("llmserve.v1.GenerateService") == "SERVING"
        assert client.tokenize("Hello world") == smollm2_tokenizer().encode("Hello world")
        assert len(client.tokenize(messages=[("user", "Hello")])) > 2
        assert client.model_info().vocab_size == 49152
        assert client.get_session("no-such-session") is None
        assert client.delete_session("no-such-session") is False
        client.generate_text(PROMPT, max_new_tokens=2, session_id="lib-1")
        session = client.get_session("lib-1")
        assert session is not None and session.cached_tokens > 0
        assert client.delete_session("lib-1") is True


def test_errors_are_rpc_errors(server: ServerThread) -> None:
    with Client(server.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate_text(PROMPT, top_p=0.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            client.generate_text(PROMPT, max_new_tokens=900, ignore_eos=True, timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(ValueError):
        build_request(PROMPT, token_ids=[1])


def test_closing_the_stream_early_cancels_it(server: ServerThread) -> None:
    with Client(server.address, timeout=30) as client:
        stream = client.generate(PROMPT, max_new_tokens=900, ignore_eos=True)
        next(stream)
        assert server.engine.num_running == 1
        stream.close()
        assert wait_until(lambda: server.engine.num_running == 0, timeout=2)


async def test_async_client(server: ServerThread) -> None:
    async with AsyncClient(server.address, timeout=30) as client:
        assert await client.health() == "SERVING"
        texts = [r.text async for r in client.generate(PROMPT, max_new_tokens=8, ignore_eos=True)]
        assert len(texts) >= 2
        assert await client.generate_text(PROMPT, max_new_tokens=8, ignore_eos=True) == "".join(texts)
        assert await client.tokenize("Hello world") == smollm2_tokenizer().encode("Hello world")
        assert (await client.model_info()).context_length > 0
        assert await client.get_session("nope") is None
        assert await client.delete_session("nope") is False

        stream = client.generate(PROMPT, max_new_tokens=900, ignore_eos=True)
        await anext(stream)
        await stream.aclose()
        assert wait_until(lambda: server.engine.num_running == 0, timeout=2)


def test_tls_options(tmp_path) -> None:
    (tmp_path / "ca.pem").write_bytes(b"ca")
    (tmp_path / "cert.pem").write_bytes(b"cert")
    (tmp_path / "key.pem").write_bytes(b"key")
    tls = TLS.from_files(ca=tmp_path / "ca.pem", cert=tmp_path / "cert.pem", key=tmp_path / "key.pem")
    assert tls == TLS(root_certificates=b"ca", private_key=b"key", certificate_chain=b"cert")
    with pytest.raises(ValueError):
        TLS.from_files(cert=tmp_path / "cert.pem")
    Client("localhost:1", tls=True).close()  # system roots; no connection is made until a call
