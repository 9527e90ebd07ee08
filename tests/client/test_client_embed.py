"""The client's Embed: embed_request's inputs and options, Client.embed, AsyncClient.embed and `llmserve-client
embed`, against a real grpc.aio server on a loopback port. Its Embed handler is stubbed here (the real server's Embed
is tests/service/test_embed.py's): it records each request and answers with vectors made from
it, so that the tests see what went over the wire and what the client made of the answer."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from llmserve_client import AsyncClient, Client, embed_request, pb
from llmserve_client.cli import main
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc


class StubEmbed(generate_pb2_grpc.GenerateServiceServicer):
    """Embed answers each input with [its index, its length, dimensions]: the text's characters, the ids' count or
    the messages' count; an input "bad" is INVALID_ARGUMENT naming it; a request whose pooling is CLS gets a
    classifier's answer (labels and probabilities)."""

    def __init__(self) -> None:
        self.requests: list[pb.EmbedRequest] = []

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.EmbedResponse:
        self.requests.append(request)
        response = pb.EmbedResponse(request_id=request.request_id or "generated")
        for index, item in enumerate(request.inputs):
            kind = item.WhichOneof("input")
            if kind == "text" and item.text == "bad":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"inputs[{index}]: not embeddable")
            size = {"text": len(item.text), "token_ids": len(item.token_ids.ids), "chat": len(item.chat.messages)}
            embedding = response.embeddings.add(index=index, prompt_tokens=size[str(kind)], truncated=index == 1)
            embedding.values.extend([float(index), float(size[str(kind)]), float(request.dimensions)])
            if request.pooling == pb.POOLING_CLS:
                embedding.probabilities.extend([0.25, 0.75])
        if request.pooling == pb.POOLING_CLS:
            response.labels.extend(["negative", "positive"])
        response.usage.prompt_tokens = sum(e.prompt_tokens for e in response.embeddings)
        return response


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[StubEmbed, str]]:
    """A grpc.aio server with the stub on 127.0.0.1, on an event loop in a thread of its own."""
    servicer = StubEmbed()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield servicer, f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_embed_request_takes_every_kind_of_input() -> None:
    request = embed_request(
        [
            "a text",
            [101, 2023, 102],
            [{"role": "user", "content": "hi"}, ("assistant", "hello")],
            pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")]),
            pb.EmbedInput(text="ready"),
        ]
    )
    kinds = [item.WhichOneof("input") for item in request.inputs]
    assert kinds == ["text", "token_ids", "chat", "chat", "text"]
    assert list(request.inputs[1].token_ids.ids) == [101, 2023, 102]
    assert [(m.role, m.content) for m in request.inputs[2].chat.messages] == [("user", "hi"), ("assistant", "hello")]
    assert request.inputs[4].text == "ready"
    # Options left at None stay unset: the model's defaults apply.
    assert not request.HasField("normalize") and not request.HasField("dimensions")
    assert (request.truncate, request.pooling) == (pb.TRUNCATION_UNSPECIFIED, pb.POOLING_UNSPECIFIED)


def test_embed_request_options() -> None:
    request = embed_request(
        "one", normalize=False, dimensions=128, truncate="keep-end", pooling="LAST", request_id="r1", priority=3
    )
    assert [i.text for i in request.inputs] == ["one"]
    assert request.HasField("normalize") and request.normalize is False
    assert request.dimensions == 128
    assert (request.truncate, request.pooling) == (pb.TRUNCATION_KEEP_END, pb.POOLING_LAST)
    assert (request.request_id, request.priority) == ("r1", 3)
    assert embed_request("x", truncate="keep_start").truncate == pb.TRUNCATION_KEEP_START


@pytest.mark.parametrize(
    ("inputs", "options", "error"),
    [
        ([1, 2, 3], {}, TypeError),  # token ids go in a list per input
        ([b"bytes"], {}, TypeError),
        ([3.5], {}, TypeError),
        (["x"], {"truncate": "middle"}, ValueError),
        (["x"], {"pooling": "first"}, ValueError),
    ],
)
def test_embed_request_refuses_what_it_cannot_send(inputs: Any, options: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        embed_request(inputs, **options)


def test_client_embed(stub: tuple[StubEmbed, str]) -> None:
    servicer, address = stub
    with Client(address, timeout=10) as client:
        response = client.embed(["abcd", [1, 2]], dimensions=3, request_id="e-1")
        assert servicer.requests[-1] == embed_request(["abcd", [1, 2]], dimensions=3, request_id="e-1")
        assert response.request_id == "e-1"
        assert [list(e.values) for e in response.embeddings] == [[0.0, 4.0, 3.0], [1.0, 2.0, 3.0]]
        assert [e.index for e in response.embeddings] == [0, 1]
        assert response.usage.prompt_tokens == 6
        one = client.embed("single")
        assert [i.text for i in servicer.requests[-1].inputs] == ["single"] and len(one.embeddings) == 1
        ready = embed_request(["r"], normalize=True)
        client.embed(ready)
        assert servicer.requests[-1] == ready
        with pytest.raises(grpc.RpcError) as err:
            client.embed(["fine", "bad"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs[1]" in (err.value.details() or "")


async def test_async_client_embed(stub: tuple[StubEmbed, str]) -> None:
    servicer, address = stub
    async with AsyncClient(address, timeout=10) as client:
        response = await client.embed([[{"role": "user", "content": "hi"}]], pooling="cls")
        assert servicer.requests[-1].pooling == pb.POOLING_CLS
        assert list(response.labels) == ["negative", "positive"]
        assert list(response.embeddings[0].probabilities) == [0.25, 0.75]
        assert list(response.embeddings[0].values) == [0.0, 1.0, 0.0]


def test_cli_embed(stub: tuple[StubEmbed, str], capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = stub
    argv = ["--address", address, "embed", "abc", "de", "--dimensions", "2", "--truncate", "keep-end"]
    assert main([*argv, "--no-normalize", "--pooling", "mean", "--request-id", "cli-1", "--stats"]) == 0
    sent = servicer.requests[-1]
    assert sent == embed_request(
        ["abc", "de"], normalize=False, dimensions=2, truncate="keep_end", pooling="mean", request_id="cli-1"
    )
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines == [
        {"index": 0, "values": [0.0, 3.0, 2.0], "prompt_tokens": 3},
        {"index": 1, "values": [1.0, 2.0, 2.0], "prompt_tokens": 2, "truncated": True},
    ]
    assert "[cli-1] prompt_tokens=5" in err


def test_cli_embed_reads_stdin_sends_chat_and_prints_probabilities(
    stub: tuple[StubEmbed, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    servicer, address = stub
    monkeypatch.setattr("sys.stdin", io.StringIO("first line\n\nsecond line\n"))
    assert main(["--address", address, "embed", "-", "third", "--chat", "--pooling", "cls"]) == 0
    sent = servicer.requests[-1]
    assert [[(m.role, m.content) for m in i.chat.messages] for i in sent.inputs] == [
        [("user", "first line")],
        [("user", "second line")],
        [("user", "third")],
    ]
    assert not sent.HasField("normalize")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["probabilities"] for line in lines] == [{"negative": 0.25, "positive": 0.75}] * 3


def test_cli_embed_reports_an_error(stub: tuple[StubEmbed, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, address = stub
    assert main(["--address", address, "embed", "bad"]) == 1
    assert "error: INVALID_ARGUMENT: inputs[0]: not embeddable" in capsys.readouterr().err
