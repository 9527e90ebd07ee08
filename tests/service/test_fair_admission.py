"""Fair admission over gRPC: Embed calls count against the caps by their inputs, admitted whole or refused whole
(RESOURCE_EXHAUSTED with RetryInfo), so that large Embed calls beside Generate streams never fill the engine's
queue: every stream completes. The tiny Llama with mean pooling serves both; an engine queue of 80 (--max-waiting)
= 16 streams + 64 pooling inputs; calls of 32 inputs. One server for the module."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from harness import ServerThread, engine_config, tiny_model

from llmserve.config import InputLimits
from llmserve.models.loader import with_pooling
from llmserve_client import pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

STREAMS, POOLING_INPUTS, CALL_INPUTS = 16, 64, 32


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from llmserve.engine.frontend.async_engine import AsyncEngine

    config = engine_config(max_waiting=STREAMS + POOLING_INPUTS, max_num_seqs=8, max_num_batched_tokens=64)
    engine = AsyncEngine(with_pooling(tiny_model(), None, "mean"), config)
    srv = ServerThread(
        engine,
        max_concurrent_streams=STREAMS,
        max_pooling_inputs=POOLING_INPUTS,
        limits=InputLimits(max_embed_inputs=CALL_INPUTS),
    ).start()
    yield srv
    srv.stop()


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["river", "stone", "light", "market", "quiet", "number", "garden", "signal", "paper", "north"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(20, 60))) for _ in range(CALL_INPUTS)]


def _embed(stub: generate_pb2_grpc.GenerateServiceStub, seed: int) -> str:
    """OK with every vector, or refused whole by admission with a retry delay: what happened."""
    try:
        response = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in _texts(seed)]), timeout=120)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        assert "--max-pooling-inputs" in err.details(), err.details()
        status = rpc_status.from_call(err)
        retry = error_details_pb2.RetryInfo()
        assert status is not None and any(d.Unpack(retry) for d in status.details)
        return "refused"
    assert len(response.embeddings) == CALL_INPUTS and all(len(e.values) == 64 for e in response.embeddings)
    return "OK"


def _generate(stub: generate_pb2_grpc.GenerateServiceStub, i: int) -> int:
    request = pb.GenerateRequest(
        text=f"stream {i} tells a story", stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True)
    )
    *_, last = stub.Generate(request, timeout=120)
    return int(last.usage.completion_tokens)


def test_large_embed_calls_beside_streams_leave_every_stream_complete(server: ServerThread) -> None:
    """8 Embed calls of 32 inputs (256 engine requests, over three times the queue) at once with 16 streams, twice:
    every stream gets its 24 tokens; each Embed call is answered whole or refused whole, and the cap refuses some."""
    with grpc.insecure_channel(server.address) as channel, ThreadPoolExecutor(24) as pool:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        outcomes: list[str] = []
        for round_ in range(2):
            embeds = [pool.submit(_embed, stub, 100 * round_ + i) for i in range(8)]
            streams = [pool.submit(_generate, stub, i) for i in range(STREAMS)]
            assert [s.result() for s in streams] == [24] * STREAMS
            outcomes += [e.result() for e in embeds]
    assert "OK" in outcomes and "refused" in outcomes, outcomes
