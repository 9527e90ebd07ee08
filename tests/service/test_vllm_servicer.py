"""vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine) on a real server, called over gRPC as smg calls it: the
same engine, admission, limits and call records as llmserve.v1, errors naming the vLLM field, the RPCs a gateway
uses at registration and in routing."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_engine import FakeEngine
from harness import ServerThread, bad_request_fields, smollm2_tokenizer, tiny_engine, wait_until
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from test_grpcurl import GRPCURL, grpcurl, json_messages

from llmserve_client import build_request
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc

PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def vllm(server: ServerThread) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def generate(request_id: str = "r", stream: bool = True, ids: list[int] = PROMPT, **sampling) -> vpb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return vpb.GenerateRequest(
        request_id=request_id,
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(**sampling),
        stream=stream,
    )


def test_streamed_chunks_carry_only_new_ids_and_each_completion_ends_with_one_complete(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, stub: generate_pb2_grpc.GenerateServiceStub
) -> None:
    own = list(
        stub.Generate(build_request(token_ids=PROMPT, max_new_tokens=12, ignore_eos=True, return_token_ids=True))
    )
    own_ids = [t for r in own for t in r.token_ids]
    responses = list(vllm.Generate(generate(max_tokens=12, ignore_eos=True), timeout=60))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[-1] == "complete" and kinds.count("complete") == 1  # the stream closes after the last one
    assert [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids] == own_ids
    assert all(len(r.chunk.token_ids) == r.chunk.completion_tokens for r in responses if r.HasField("chunk"))
    done = responses[-1].complete
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("length", len(PROMPT), 12)
    assert not done.output_ids  # streamed: the chunks carried them
    # Not streamed: one Complete per completion with all its ids; n = 2 sampled with a seed, completion i as
    # llmserve's own completion i.
    sampled = dict(max_tokens=8, ignore_eos=True, n=2, temperature=1.0, seed=11)
    whole = list(vllm.Generate(generate("r2", stream=False, **sampled), timeout=60))
    assert [r.WhichOneof("response") for r in whole] == ["complete", "complete"]
    own_n = list(
        stub.Generate(
            build_request(
                token_ids=PROMPT,
                max_new_tokens=8,
                ignore_eos=True,
                n=2,
                temperature=1.0,
                seed=11,
                return_token_ids=True,
            )
        )
    )
    by_index = {r.complete.index: list(r.complete.output_ids) for r in whole}
    assert by_index == {i: [t for r in own_n if r.index == i for t in r.token_ids] for i in (0, 1)}


def test_logprobs_and_what_matched_a_stop(vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    first = list(vllm.Generate(generate(max_tokens=6, ignore_eos=True, logprobs=2), timeout=60))
    chunks = [r.chunk for r in first if r.HasField("chunk")]
    ids = [t for c in chunks for t in c.token_ids]
    assert [t for c in chunks for t in c.output_logprobs.token_ids] == ids
    assert all(len(top.token_ids) == 2 for c in chunks for top in c.output_logprobs.top_logprobs)
    # A stop token: "stop", naming the token.
    stopped = list(vllm.Generate(generate(max_tokens=6, ignore_eos=True, stop_token_ids=[ids[2]]), timeout=60))
    done = stopped[-1].complete
    assert (done.finish_reason, done.matched_token_id, done.completion_tokens) == ("stop", ids[2], 3)
    # A stop string: "stop", naming the string.
    tokenizer = smollm2_tokenizer()
    text = tokenizer.decode(ids)
    stop = text[len(text) // 2 :][:3]
    by_string = list(vllm.Generate(generate(max_tokens=6, ignore_eos=True, stop=[stop, "never there"]), timeout=60))
    assert by_string[-1].complete.finish_reason == "stop"
    assert by_string[-1].complete.matched_stop_str == stop


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (dict(temperature=-1.0), "sampling_params.temperature"),
        (dict(top_p=1.5), "sampling_params.top_p"),
        (dict(min_p=2.0), "sampling_params.min_p"),
        (dict(frequency_penalty=3.0), "sampling_params.frequency_penalty"),
        (dict(max_tokens=5000), "sampling_params.max_tokens"),
        (dict(max_tokens=4, min_tokens=9), "sampling_params.min_tokens"),
        (dict(seed=-1), "sampling_params.seed"),
        (dict(logprobs=-1), "sampling_params.logprobs"),
        (dict(logprobs=21), "sampling_params.logprobs"),
        (dict(n=99), "sampling_params.n"),
        (dict(stop_token_ids=[10**6]), "sampling_params.stop_token_ids"),
        (dict(logit_bias={10**6: 1.0}), "sampling_params.logit_bias"),
        (dict(json_schema='{"type": "object", "not": {}}'), "sampling_params.json_schema"),
        (dict(json_schema="{not json"), "sampling_params.json_schema"),
        (dict(regex="("), "sampling_params.regex"),
        (dict(choice=vpb.ChoiceConstraint(choices=[])), "sampling_params.choice.choices"),
        (dict(structural_tag='{"type": "structural_tag"}'), "sampling_params.structural_tag"),
        (dict(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
        (dict(prompt_logprobs=21), "sampling_params.prompt_logprobs"),
        (dict(stop=["x"] * 17), "sampling_params.stop"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_vllm_field(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, sampling: dict, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(vllm.Generate(generate(**sampling), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: ")
    assert bad_request_fields(err.value) == [field]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (vpb.GenerateRequest(request_id="x"), "input"),
        (vpb.GenerateRequest(request_id="x", tokenized=vpb.TokenizedInput()), "tokenized.input_ids"),
        (vpb.GenerateRequest(request_id="x", tokenized=vpb.TokenizedInput(input_ids=[10**6])), "tokenized.input_ids"),
        (vpb.GenerateRequest(request_id="x" * 200, text="hi"), "request_id"),
        (vpb.GenerateRequest(request_id="x", text="hi", data_parallel_rank=2), "data_parallel_rank"),
        (vpb.GenerateRequest(request_id="x", text="hi", kv_transfer_params_json="{}"), "kv_transfer_params"),
    ],
)
def test_bad_requests_name_the_vllm_field(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, request_: vpb.GenerateRequest, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(vllm.Generate(request_, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == [field]


def test_text_input_is_tokenized_as_llmserve_tokenizes_it(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, stub: generate_pb2_grpc.GenerateServiceStub
) -> None:
    request = vpb.GenerateRequest(
        request_id="t",
        text="Once upon a time",
        sampling_params=vpb.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        stream=False,
    )
    (done,) = list(vllm.Generate(request, timeout=60))
    own = list(
        stub.Generate(build_request("Once upon a time", max_new_tokens=5, ignore_eos=True, return_token_ids=True))
    )
    assert list(done.complete.output_ids) == [t for r in own for t in r.token_ids]
    assert done.complete.prompt_tokens == len(smollm2_tokenizer().encode("Once upon a time"))


def test_abort_and_a_cancelled_stream_free_the_engine_request(
    server: ServerThread, vllm: vllm_engine_pb2_grpc.VllmEngineStub
) -> None:
    for how in ("abort", "cancel"):
        call = vllm.Generate(generate(f"long-{how}", max_tokens=900, ignore_eos=True), timeout=120)
        next(call)
        assert server.engine.num_running == 1
        loads = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
        assert loads.num_running_reqs == 1 and 0 < loads.token_usage <= 1
        if how == "abort":
            vllm.Abort(vpb.AbortRequest(request_ids=[f"long-{how}", "no-such-call"]), timeout=10)
            rest = list(call)  # the stream ends at once, OK, its completion "abort"
            assert rest[-1].complete.finish_reason == "abort" and call.code() == grpc.StatusCode.OK
        else:
            call.cancel()
        assert wait_until(lambda: server.engine.num_running == 0, timeout=5)
        assert server.engine.stats().kv_blocks_used == 0
    loads = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=10)
    assert (loads.dp_rank_count, loads.loads[0].num_running_reqs, loads.loads[0].token_usage) == (1, 0, 0.0)


def test_registration_facts(server: ServerThread, vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    assert vllm.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
    info = vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30)
    model = server.engine.model_info
    assert info.is_generation and info.served_model_name == model.name
    assert (info.max_context_length, info.vocab_size) == (model.context_length, model.vocab_size)
    assert list(info.eos_token_ids) == [smollm2_tokenizer().eos_token_id]
    folder = Path(info.tokenizer_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    assert (
        json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == smollm2_tokenizer().chat_template
    )
    server_info = vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert (server_info.server_type, server_info.block_size, server_info.is_paused) == ("vllm-grpc", 16, False)


def test_get_tokenizer_streams_a_zip_that_tokenizes_as_the_server_does(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub,
) -> None:
    from transformers import AutoTokenizer

    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert len(chunks) > 1 and all(len(c.data) <= 64 * 1024 for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        assert all("/" not in name for name in names) and len(names) <= 50
        folder = Path(__import__("tempfile").mkdtemp())
        archive.extractall(folder)
    loaded, served = AutoTokenizer.from_pretrained(folder), smollm2_tokenizer()
    messages = [{"role": "user", "content": "Hi there, how are you?"}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True) == served.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert loaded.encode("Ünïcode and spaces  ok") == served.encode("Ünïcode and spaces  ok")


def test_embed_on_a_model_without_pooling_is_failed_precondition(vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    request = vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]))
    with pytest.raises(grpc.RpcError) as err:
        vllm.Embed(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "serves no Embed" in err.value.details()


def test_unimplemented_rpcs_say_so(vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    calls = [
        lambda: vllm.FlushCache(common_pb2.FlushCacheRequest(), timeout=10),
        lambda: vllm.StartProfile(common_pb2.StartProfileRequest(), timeout=10),
        lambda: vllm.StopProfile(common_pb2.StopProfileRequest(), timeout=10),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "llmserve does not implement VllmEngine/" in err.value.details()


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed")
def test_grpcurl_reaches_vllm_generate_through_reflection_alone(server: ServerThread) -> None:
    out = grpcurl(server, "list")
    assert out.returncode == 0, out.stderr
    assert "vllm.grpc.engine.VllmEngine" in out.stdout.split()
    assert not any(name.startswith(("sglang", "trtllm", "mlx", "tokenspeed")) for name in out.stdout.split())
    request = """{"request_id": "g1", "tokenized": {"input_ids": [1, 2, 3, 4]}, "stream": true,
                  "sampling_params": {"temperature": 0, "max_tokens": 4, "ignore_eos": true}}"""
    out = grpcurl(server, "vllm.grpc.engine.VllmEngine/Generate", data=request)
    assert out.returncode == 0, out.stderr
    messages = json_messages(out.stdout)
    assert sum(len(m["chunk"]["token_ids"]) for m in messages[:-1]) == 4
    assert messages[-1]["complete"]["finish_reason"] == "length"


def test_each_vllm_call_is_one_record_and_draining_is_unhealthy(caplog: pytest.LogCaptureFixture) -> None:
    """A server of its own: one request log line per call (from its one call record), then its drain."""
    srv = ServerThread(FakeEngine()).start()
    try:
        with grpc.insecure_channel(srv.address) as channel, caplog.at_level("INFO", logger="llmserve.requests"):
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            list(vllm.Generate(generate("one", max_tokens=3), timeout=30))
            with pytest.raises(grpc.RpcError):
                list(vllm.Generate(generate("two", top_p=2.0), timeout=30))
            lines = [r.getMessage() for r in caplog.records if r.name == "llmserve.requests"]
            assert len(lines) == 2
            assert lines[0].startswith("request_id=one status=OK finish=length prompt_tokens=40 ")
            assert "completion_tokens=3 " in lines[0]
            assert lines[1].startswith("request_id=two status=INVALID_ARGUMENT ")
            srv.run(_begin_drain(srv))
            health = vllm.HealthCheck(vpb.HealthCheckRequest(), timeout=10)
            assert not health.healthy and "draining" in health.message
    finally:
        srv.stop()


async def _begin_drain(srv: ServerThread) -> None:
    srv.server.servicer.begin_drain()


def test_abort_reaches_only_the_callers_own_request(tmp_path: Path) -> None:
    """With authentication on, request ids belong to their identity: bob's Abort of alice's id is no call of his. (The
    scoping is the edge's alone: the core on a thread.)"""
    tokens = tmp_path / "tokens.csv"
    tokens.write_text("alice-token,alice\nbob-token,bob\n")
    srv = ServerThread(tiny_engine(in_process=True), auth_token_file=str(tokens)).start()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            alice, bob = [("authorization", "Bearer alice-token")], [("authorization", "Bearer bob-token")]
            call = vllm.Generate(generate("same-id", max_tokens=900, ignore_eos=True), metadata=alice, timeout=120)
            next(call)
            vllm.Abort(vpb.AbortRequest(request_ids=["same-id"]), metadata=bob, timeout=10)
            time.sleep(0.5)
            assert srv.engine.num_running == 1
            vllm.Abort(vpb.AbortRequest(request_ids=["same-id"]), metadata=alice, timeout=10)
            assert list(call)[-1].complete.finish_reason == "abort"
            assert wait_until(lambda: srv.engine.num_running == 0, timeout=5)
    finally:
        srv.stop()


def test_kv_events_carry_the_callers_own_blocks_only(tmp_path: Path) -> None:
    """SubscribeKvEvents with authentication on: alice's subscriber gets the blocks her prompt stored (tokens, chained
    parents, the block size); bob's gets nothing of hers (the blocks are salted with alice's identity)."""
    tokens = tmp_path / "tokens.csv"
    tokens.write_text("alice-token,alice\nbob-token,bob\n")
    srv = ServerThread(tiny_engine(), auth_token_file=str(tokens)).start()
    alice, bob = [("authorization", "Bearer alice-token")], [("authorization", "Bearer bob-token")]
    try:
        with grpc.insecure_channel(srv.address) as channel:
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            streams = {
                who: vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=md, timeout=30)
                for who, md in (("alice", alice), ("bob", bob))
            }
            time.sleep(0.3)  # both subscribed
            list(vllm.Generate(generate("a1", max_tokens=2, ignore_eos=True), metadata=alice, timeout=30))
            batch = next(streams["alice"])
            blocks = [e.stored for e in batch.events if e.HasField("stored")]
            assert [list(s.blocks[0].token_ids) for s in blocks[: len(PROMPT) // 16]] == [
                PROMPT[i : i + 16] for i in range(0, len(PROMPT) - 15, 16)
            ]
            assert all(s.blocks[0].block_size == 16 for s in blocks)
            assert not blocks[0].HasField("parent_block_hash")
            assert blocks[1].parent_block_hash == blocks[0].blocks[0].block_hash
            assert batch.sequence_number == 1
            time.sleep(0.3)
            streams["bob"].cancel()
            assert [b for b in _drain(streams["bob"])] == []
            streams["alice"].cancel()
    finally:
        srv.stop()


def _drain(stream) -> list:
    out = []
    try:
        for item in stream:
            out.append(item)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.CANCELLED
    return out


def test_a_kv_event_subscription_answers_at_once_on_an_idle_replica(vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    """smg waits 2 s for SubscribeKvEvents to answer (its response headers) and otherwise marks the replica
    unreachable and stops routing to it; a replica with no cache event to send must answer all the same."""
    stream = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30)
    answered = threading.Event()
    threading.Thread(target=lambda: (stream.initial_metadata(), answered.set()), daemon=True).start()
    try:
        assert answered.wait(2.0), "no response headers within smg's 2 s"
    finally:
        stream.cancel()


def test_kv_events_tell_a_subscriber_of_the_blocks_the_cache_removed() -> None:
    """As smg's cache-aware router follows a replica: blocks the pool evicts to make room reach the subscriber as
    removed (KvBlocksRemoved, by the ids it was told when they were stored), so that it stops sending turns to KV that
    is gone. A pool of 8 blocks: a second request that needs all 8 evicts the first one's cached blocks."""
    srv = ServerThread(tiny_engine(kv_cache_tokens=8 * 16, max_num_seqs=2)).start()
    first = list(range(1000, 1040))  # 2 full blocks cached once it ends
    second = list(range(2000, 2124))  # 8 blocks with its answer: the free ones, then the first's cached ones
    try:
        with grpc.insecure_channel(srv.address) as channel:
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            stream = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30)
            time.sleep(0.3)  # subscribed
            list(vllm.Generate(generate("a", ids=first, max_tokens=2, ignore_eos=True), timeout=30))
            stored: set[int] = set()
            while len(stored) < 2:
                batch = next(stream)
                stored |= {e.stored.blocks[0].block_hash for e in batch.events if e.HasField("stored")}
            list(vllm.Generate(generate("b", ids=second, max_tokens=2, ignore_eos=True), timeout=30))
            removed: set[int] = set()
            while not stored <= removed:
                batch = next(stream)  # DEADLINE_EXCEEDED (a failure) if the removals never come
                removed |= {h for e in batch.events if e.HasField("removed") for h in e.removed.block_hashes}
            stream.cancel()
    finally:
        srv.stop()


def test_prompt_logprobs_are_llmserves_own_on_the_first_chunk_and_in_a_whole_calls_complete(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, stub: generate_pb2_grpc.GenerateServiceStub
) -> None:
    own = list(stub.Generate(build_request(token_ids=PROMPT, max_new_tokens=3, prompt_top_logprobs=2)))
    scores = list(own[0].prompt_logprobs)
    assert len(scores) == len(PROMPT) - 1
    responses = list(vllm.Generate(generate(max_tokens=3, ignore_eos=True, prompt_logprobs=2), timeout=60))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    inputs = chunks[0].input_logprobs
    assert not any(c.HasField("input_logprobs") for c in chunks[1:])
    assert list(inputs.token_ids) == PROMPT
    assert not inputs.token_logprobs[0].HasField("value")
    assert [lp.value for lp in inputs.token_logprobs[1:]] == [lp.logprob for lp in scores]
    tops = [[t.token_id for t in lp.top_logprobs] for lp in scores]
    assert [list(t.token_ids) for t in inputs.top_logprobs[1:]] == tops
    whole = list(vllm.Generate(generate("r-whole", stream=False, max_tokens=3, prompt_logprobs=0), timeout=60))
    done = whole[-1].complete
    assert [lp.value for lp in done.input_logprobs.token_logprobs[1:]] == [lp.logprob for lp in scores]
    assert len(done.input_logprobs.top_logprobs) == 0
    assert done.cached_tokens == 0  # the prompt was computed for the scores, not read from the cache
