"""LoRA adapters through a real gRPC server (its engine in an engine process, as `python -m llmserve` runs it):
GenerateRequest.adapter against PEFT's merged model, NOT_FOUND naming `adapter`, GetModelInfo's list, the
AdapterService calls and their refusals (each naming the file or the field) while another stream goes on, the
admin rule with authentication on, and the LoRA metrics."""

from __future__ import annotations

import copy
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import ServerThread, bad_request_fields, tiny_engine, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from llmserve_client.pb.llmserve.v1 import adapters_pb2 as apb
from llmserve_client.pb.llmserve.v1 import adapters_pb2_grpc, generate_pb2_grpc
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from tests.engine.lora.peft_adapters import make_adapter
from tests.testing import greedy_reference

PROMPT = [1, 504, 3458, 314, 260, 2913, 28]


class Adapters:
    def __init__(self, root: Path) -> None:
        base = tiny_model().model
        base.set_attn_implementation("sdpa")
        self.base = copy.deepcopy(base)
        self.sql = make_adapter(base, root / "sql", seed=1, r=4, lora_alpha=8)
        self.chat = make_adapter(base, root / "chat", seed=2, r=8, lora_alpha=8, target_modules=["q_proj", "down_proj"])
        self.high = make_adapter(base, root / "high", seed=3, merge=False, r=32).folder  # above --max-lora-rank 16
        self.broken = root / "broken"
        shutil.copytree(self.sql.folder, self.broken)
        (self.broken / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
        other = LlamaForCausalLM(LlamaConfig(**{**base.config.to_dict(), "intermediate_size": 96}))
        self.other_shape = make_adapter(other, root / "other", seed=4, merge=False, r=4).folder


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    return Adapters(tmp_path_factory.mktemp("service-adapters"))


@pytest.fixture(scope="module")
def served(made: Adapters) -> Iterator[tuple[ServerThread, int]]:
    engine = tiny_engine(loras=(("sql", str(made.sql.folder)),), max_loras=2, max_cpu_loras=2)
    srv = ServerThread(engine, metrics=True).start()
    yield srv, srv.metrics_port
    srv.stop()


def generate(stub: Any, adapter: str = "", prompt: list[int] = PROMPT, new: int = 8) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), adapter=adapter)
    request.stopping.max_new_tokens, request.stopping.ignore_eos = new, True
    request.response.token_ids = True
    return [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]


def test_generate_with_an_adapter_and_the_refusals(made: Adapters, served: tuple[ServerThread, int]) -> None:
    srv, metrics_port = served
    with grpc.insecure_channel(srv.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        admin = adapters_pb2_grpc.AdapterServiceStub(channel)
        assert generate(stub, "sql") == greedy_reference(made.sql.merged, PROMPT, 8)
        assert generate(stub) == greedy_reference(made.base, PROMPT, 8)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (list(info.adapters), info.max_loras, info.max_lora_rank) == (["sql"], 2, 16)
        for name, code in (("nope", grpc.StatusCode.NOT_FOUND), ("bad name!", grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, name)
            assert err.value.code() == code and bad_request_fields(err.value) == ["adapter"], err.value.details()

        # Another stream runs on through every refusal below.
        long_prompt = PROMPT * 3
        beside: list[list[int]] = []
        runner = threading.Thread(target=lambda: beside.append(generate(stub, "sql", long_prompt, 120)))
        runner.start()
        refusals = [
            ("a", "/no/such/folder", grpc.StatusCode.NOT_FOUND, "/no/such/folder"),
            ("a", str(made.broken), grpc.StatusCode.INVALID_ARGUMENT, "adapter_model.safetensors"),
            ("a", str(made.high), grpc.StatusCode.INVALID_ARGUMENT, "above --max-lora-rank 16"),
            ("a", str(made.other_shape), grpc.StatusCode.INVALID_ARGUMENT, "do not fit the served model"),
            ("sql", str(made.chat.folder), grpc.StatusCode.ALREADY_EXISTS, "'sql'"),
            ("", str(made.chat.folder), grpc.StatusCode.INVALID_ARGUMENT, "name"),
        ]
        for name, path, code, named in refusals:
            with pytest.raises(grpc.RpcError) as err:
                admin.LoadAdapter(apb.LoadAdapterRequest(name=name, path=path), timeout=30)
            assert err.value.code() == code and named in err.value.details(), (path, err.value.details())
        loaded = admin.LoadAdapter(apb.LoadAdapterRequest(name="chat", path=str(made.chat.folder)), timeout=30)
        assert (loaded.adapter.rank, sorted(loaded.adapter.target_modules)) == (8, ["down_proj", "q_proj"])
        assert generate(stub, "chat") == greedy_reference(made.chat.merged, PROMPT, 8)
        assert list(stub.GetModelInfo(pb.GetModelInfoRequest()).adapters) == ["chat", "sql"]
        runner.join(60)
        assert beside == [greedy_reference(made.sql.merged, long_prompt, 120)]

        listed = admin.ListAdapters(apb.ListAdaptersRequest(), timeout=30)
        assert [a.name for a in listed.adapters] == ["chat", "sql"] and listed.max_cpu_loras == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'llmserve_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in text
        assert 'vllm:lora_requests_info{max_lora="2"' in text
        assert 'llmserve_lora_requests_total{adapter="sql"} 2.0' in text
        assert 'llmserve_lora_requests_total{adapter="chat"} 1.0' in text

        assert admin.UnloadAdapter(apb.UnloadAdapterRequest(name="chat"), timeout=30).draining_requests == 0
        with pytest.raises(grpc.RpcError) as err:
            admin.UnloadAdapter(apb.UnloadAdapterRequest(name="chat"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and bad_request_fields(err.value) == ["name"]
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, "chat")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_loading_beyond_max_cpu_loras_while_all_are_in_use(made: Adapters) -> None:
    srv = ServerThread(tiny_engine(in_process=True, loras=(("sql", str(made.sql.folder)),), max_cpu_loras=1)).start()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), adapter="sql")
            request.stopping.max_new_tokens, request.stopping.ignore_eos = 400, True
            request.response.token_ids = True
            stream = stub.Generate(request, timeout=60)
            next(stream)  # the request holds "sql", the one adapter memory holds
            admin = adapters_pb2_grpc.AdapterServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                admin.LoadAdapter(apb.LoadAdapterRequest(name="chat", path=str(made.chat.folder)), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-cpu-loras" in err.value.details()
            assert len([t for r in stream for t in r.token_ids]) == 399  # the stream goes on to its end
            admin.LoadAdapter(apb.LoadAdapterRequest(name="chat", path=str(made.chat.folder)), timeout=30)
    finally:
        srv.stop()


def test_adapter_service_is_for_admins_with_auth_on(made: Adapters, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.csv"
    tokens.write_text("ops-token,ops\nuser-token,alice\n")
    engine = tiny_engine(in_process=True, enable_lora=True)
    srv = ServerThread(engine, auth_token_file=str(tokens), admin_identities=("ops",)).start()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            admin = adapters_pb2_grpc.AdapterServiceStub(channel)
            request = apb.LoadAdapterRequest(name="sql", path=str(made.sql.folder))
            with pytest.raises(grpc.RpcError) as err:
                admin.LoadAdapter(request, metadata=[("authorization", "Bearer user-token")], timeout=30)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--admin-identity" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                admin.ListAdapters(apb.ListAdaptersRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            loaded = admin.LoadAdapter(request, metadata=[("authorization", "Bearer ops-token")], timeout=30)
            assert loaded.adapter.name == "sql"
            # Generating with it needs no admin right.
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            gen = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), adapter="sql")
            gen.stopping.max_new_tokens, gen.stopping.ignore_eos = 4, True
            gen.response.token_ids = True
            out = [
                t for r in stub.Generate(gen, metadata=[("authorization", "Bearer user-token")]) for t in r.token_ids
            ]
            assert out == greedy_reference(made.sql.merged, PROMPT, 4)
    finally:
        srv.stop()


def test_a_server_without_lora_refuses_the_adapter_service(made: Adapters) -> None:
    srv = ServerThread(tiny_engine(in_process=True)).start()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            admin = adapters_pb2_grpc.AdapterServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                admin.ListAdapters(apb.ListAdaptersRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--enable-lora" in err.value.details()
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, "sql")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and bad_request_fields(err.value) == ["adapter"]
            assert list(stub.GetModelInfo(pb.GetModelInfoRequest()).adapters) == []
    finally:
        srv.stop()


def test_python_m_llmserve_refuses_lora_beside_bfloat16_on_the_fused_cpu_forward(
    made: Adapters, tiny_model_dir: Path
) -> None:
    """The fused CPU forward adds adapter deltas in float32 only: --lora with --dtype bfloat16 stops the start with
    status 2 and a message naming both (not a traceback)."""
    from server_process import ServerProcess

    from llmserve.engine.backends.cpu.packed_linear import bf16_available

    if not bf16_available():
        pytest.skip("below AVX512-BF16 a bfloat16 model runs transformers' layers, whose hooks serve LoRA")
    args = ("--model", str(tiny_model_dir), "--dtype", "bfloat16", "--lora", f"sql={made.sql.folder}")
    bad = ServerProcess(*args, "--history-store", "memory")
    try:
        assert bad.proc.wait(120) == 2
    finally:
        bad.kill()
    log = "".join(bad.log)
    assert "--dtype bfloat16 with LoRA adapters" in log and "Traceback" not in log, log[-2000:]


def test_python_m_llmserve_with_lora(made: Adapters, tiny_model_dir: Path) -> None:
    """What a user runs: --lora at start serves the adapter (the client's adapter=); one that cannot be served stops
    the start with status 2, naming the file."""
    from server_process import ServerProcess

    from llmserve_client import Client

    bad = ServerProcess("--model", str(tiny_model_dir), "--lora", f"x={made.high}", "--history-store", "memory")
    try:
        assert bad.proc.wait(120) == 2
    finally:
        bad.kill()
    log = "".join(bad.log)
    assert "adapter_model.safetensors" in log and "above --max-lora-rank 16" in log, log[-2000:]
    good = ServerProcess(
        "--model", str(tiny_model_dir), "--lora", f"sql={made.sql.folder}", "--history-store", "memory"
    )
    try:
        port = good.wait_serving()
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            options = dict(max_new_tokens=6, ignore_eos=True, return_token_ids=True, adapter="sql")
            out = [t for r in client.generate(token_ids=PROMPT, **options) for t in r.token_ids]
            assert out == greedy_reference(made.sql.merged, PROMPT, 6)
            assert list(client.model_info().adapters) == ["sql"]
            assert [a.name for a in client.list_adapters().adapters] == ["sql"]
    finally:
        good.kill()
