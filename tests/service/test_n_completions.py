"""n completions of one prompt through gRPC (GenerateRequest.n): the prompt is computed once and its blocks shared,
the n streams are told apart by index and each equals a single-completion call with its derived seed, seeded
replays are equal, cancelling ends all n, and --max-n, session ids, constraints and stop strings behave as the proto
documents."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import pytest
from harness import ServerThread, bad_request_fields, tiny_engine, wait_until
from test_grpcurl import GRPCURL, grpcurl, json_messages

from llmserve_client import build_request, pb
from llmserve_client.pb.llmserve.v1 import generate_pb2_grpc
from tests.engine.sched.pool_checks import check_pool
from tests.stepspy import StepSpy

MAX_N = 4
BS = 16  # the engine's default block size
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


class PromptWork:
    """Counts, per engine request id, the prompt tokens the step thread computes (wraps the scheduler's schedule)."""

    def __init__(self, core: Any) -> None:
        self.tokens: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        real = core.scheduler.schedule

        def schedule() -> Any:
            plan = real()
            with self._lock:
                for entry in plan.seqs:
                    self.tokens[entry.seq.request_id] += max(0, min(entry.end, entry.seq.num_prompt) - entry.start)
            return plan

        core.scheduler.schedule = schedule
        self._core = core

    def restore(self) -> None:
        del self._core.scheduler.schedule


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = ServerThread(tiny_engine(max_n=MAX_N)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def inner() -> Iterator[tuple[ServerThread, generate_pb2_grpc.GenerateServiceStub]]:
    """The same server with its core on a thread of this process, for the tests that look into the core's books."""
    srv = ServerThread(tiny_engine(in_process=True, max_n=MAX_N)).start()
    with grpc.insecure_channel(srv.address) as channel:
        yield srv, generate_pb2_grpc.GenerateServiceStub(channel)
    srv.stop()


def _prompt(length: int, salt: int) -> list[int]:
    """A prompt no other test sends (so that its first computation is its own)."""
    return [(salt * 7919 + 31 * i) % 40000 + 100 for i in range(length)]


def _by_index(responses: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    out: dict[int, list[pb.GenerateResponse]] = defaultdict(list)
    for response in responses:
        out[response.index].append(response)
    return dict(out)


def _tokens(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def _call(stub: generate_pb2_grpc.GenerateServiceStub, prompt: list[int], **options: Any) -> list[pb.GenerateResponse]:
    options.setdefault("max_new_tokens", 10)
    options.setdefault("ignore_eos", True)
    return list(stub.Generate(build_request(token_ids=prompt, return_token_ids=True, **options), timeout=120))


def test_n4_with_a_1000_token_prompt_computes_the_prompt_once(inner) -> None:  # noqa: ANN001
    server, stub = inner
    prompt = _prompt(990, 1)
    work = PromptWork(server.engine.core.engine_core)
    try:
        responses = _call(stub, prompt, n=4, temperature=1.0, seed=5, max_new_tokens=8, request_id="once")
    finally:
        work.restore()
    streams = _by_index(responses)
    assert sorted(streams) == [0, 1, 2, 3]
    # 61 full blocks shared, the 62nd copied (copy-on-write); each other completion computes the prompt's last token.
    taken = len(prompt) - 1
    for index, messages in streams.items():
        last = messages[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 8
        assert sum(1 for m in messages if m.finish_reason) == 1
        assert last.usage.prompt_tokens == 990
        assert last.usage.cached_prompt_tokens == (0 if index == 0 else taken)
    assert work.tokens["once"] == 990 + 3 * 1  # the prompt once, and three last tokens
    total = responses[-1].total_usage
    assert (total.prompt_tokens, total.cached_prompt_tokens, total.completion_tokens) == (990, 0, 32)
    assert not any(r.HasField("total_usage") for r in responses[:-1])
    core = server.engine.core.engine_core
    assert wait_until(lambda: not core.scheduler.live)
    assert core.pool.num_free == core.pool.num_blocks  # no block left held (the prompt's stay cached, reusable)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_stream_equals_a_single_call_with_the_derived_seed(stub, temperature: float) -> None:
    prompt = _prompt(300, 2 + int(temperature))
    seed = 2**63 - 2  # completions 2 and 3 wrap around: seeds 0 and 1
    first = _by_index(_call(stub, prompt, n=4, temperature=temperature, seed=seed))
    replay = _by_index(_call(stub, prompt, n=4, temperature=temperature, seed=seed))
    assert {i: _tokens(m) for i, m in first.items()} == {i: _tokens(m) for i, m in replay.items()}
    for i, messages in first.items():
        derived = (seed + i) % 2**63
        alone = _call(stub, prompt, temperature=temperature, seed=derived)
        assert _tokens(alone) == _tokens(messages), i
        assert {r.index for r in alone} == {0}
        if temperature:
            assert messages[-1].seed == derived == alone[-1].seed
        else:
            assert not messages[-1].HasField("seed")
    distinct = {tuple(_tokens(m)) for m in first.values()}
    assert len(distinct) == (1 if temperature == 0.0 else 4)


def test_without_a_seed_each_completion_reports_its_own_and_a_replay_with_the_first_repeats_them(stub) -> None:
    prompt = _prompt(40, 4)
    first = _by_index(_call(stub, prompt, n=3, temperature=1.0))
    seeds = [first[i][-1].seed for i in range(3)]
    assert seeds == [(seeds[0] + i) % 2**63 for i in range(3)]
    again = _by_index(_call(stub, prompt, n=3, temperature=1.0, seed=seeds[0]))
    assert [_tokens(again[i]) for i in range(3)] == [_tokens(first[i]) for i in range(3)]


def test_cancelling_the_call_ends_all_n_and_leaks_no_block(inner) -> None:  # noqa: ANN001
    server, stub = inner
    core = server.engine.core.engine_core
    call = stub.Generate(
        build_request(token_ids=_prompt(200, 5), n=4, temperature=1.0, max_new_tokens=800, ignore_eos=True),
        timeout=120,
    )
    seen: set[int] = set()
    for response in call:
        seen.add(response.index)
        if len(seen) == 4 and len(core.scheduler.running) == 4:
            break
    call.cancel()
    assert wait_until(lambda: not core.scheduler.live, timeout=30)
    assert server.engine.num_running == 0 and server.engine.num_waiting == 0
    check_pool(core.pool, [])
    assert core.pool.num_free == core.pool.num_blocks


def test_the_deadline_ends_all_n(inner) -> None:  # noqa: ANN001
    server, stub = inner
    core = server.engine.core.engine_core
    request = build_request(token_ids=_prompt(100, 6), n=4, temperature=1.0, max_new_tokens=800, ignore_eos=True)
    with StepSpy(core, step_delay_s=0.01):  # 800 steps take 8 s at least: the deadline comes first on any machine
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=1.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: not core.scheduler.live, timeout=30)
    assert core.pool.num_free == core.pool.num_blocks


@pytest.mark.parametrize(
    ("request_pb", "reason"),
    [
        (build_request("hi", n=MAX_N + 1), "--max-n"),
        (build_request("hi", n=2, session_id="n-session"), "session"),
    ],
    ids=["above-max-n", "with-session"],
)
def test_refusals_name_the_field(server: ServerThread, stub, request_pb: pb.GenerateRequest, reason: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_pb, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("n: ") and reason in err.value.details(), err.value.details()
    assert bad_request_fields(err.value) == ["n"]
    assert server.engine.num_running == 0


def test_n_with_a_constraint_each_completion_validates(stub) -> None:
    request = build_request("Trip:", n=4, json_schema=SCHEMA, temperature=1.0, seed=11, max_new_tokens=64)
    streams = _by_index(list(stub.Generate(request, timeout=120)))
    assert sorted(streams) == [0, 1, 2, 3]
    finished = 0
    for messages in streams.values():
        if messages[-1].finish_reason == pb.FINISH_REASON_LENGTH:
            continue  # may be incomplete: documented
        assert messages[-1].finish_reason in (pb.FINISH_REASON_CONSTRAINT, pb.FINISH_REASON_EOS)
        jsonschema.validate(json.loads("".join(m.text for m in messages)), SCHEMA)
        finished += 1
    assert finished >= 1


def test_n_with_stop_strings_each_completion_stops_on_its_own_text(stub) -> None:
    options = dict(n=4, temperature=1.0, seed=21, max_new_tokens=24)
    free = _by_index(list(stub.Generate(build_request("Once upon", ignore_eos=True, **options), timeout=120)))
    texts = {i: "".join(m.text for m in messages) for i, messages in free.items()}
    stop = texts[1][len(texts[1]) // 2 :][:3]  # from the middle of completion 1's text
    assert stop
    stop_request = build_request("Once upon", ignore_eos=True, stop=[stop], **options)
    stopped = _by_index(list(stub.Generate(stop_request, timeout=120)))
    for i, messages in stopped.items():
        text, reason = "".join(m.text for m in messages), messages[-1].finish_reason
        if stop in texts[i]:
            assert reason == pb.FINISH_REASON_STOP_SEQUENCE and text == texts[i][: texts[i].index(stop)], i
        else:
            assert reason == pb.FINISH_REASON_LENGTH and text == texts[i], i
    assert stopped[1][-1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed")
def test_grpcurl_asks_for_n_completions(server: ServerThread) -> None:
    data = json.dumps(
        {
            "text": "Name a colour:",
            "n": 2,
            "sampling": {"temperature": 0.8, "seed": "7"},
            "stopping": {"max_new_tokens": 4, "ignore_eos": True},
        }
    )
    out = grpcurl(server, "llmserve.v1.GenerateService/Generate", data=data)
    assert out.returncode == 0, out.stderr
    messages = json_messages(out.stdout)
    finals = [m for m in messages if "finish_reason" in m]
    assert sorted(m.get("index", 0) for m in finals) == [0, 1]  # proto3 JSON leaves index 0 out
    assert sorted(int(m["seed"]) for m in finals) == [7, 8]
    assert messages[-1]["total_usage"]["completion_tokens"] == 8
