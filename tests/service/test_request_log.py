"""The request log line and the call's status agree with what the client saw (OK, CANCELLED, DEADLINE_EXCEEDED,
UNAVAILABLE at shutdown, with the last message a cut stream still gets), and no caller can forge a line."""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from fake_engine import FakeEngine
from harness import ServerThread, tiny_engine, wait_until

from llmserve.telemetry.request_log import JsonFormatter, logfmt_value
from llmserve_client import Client, build_request, pb


class _Lines(logging.Handler):
    """The request log, formatted as the process would write it."""

    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def find(self, request_id: str) -> str:
        quoted = logfmt_value(request_id)
        matches = [line for line in self.lines if f"request_id={quoted} " in line]
        assert len(matches) == 1, (request_id, self.lines[-5:])
        return matches[0]


@pytest.fixture
def lines() -> Iterator[_Lines]:
    handler = _Lines(logging.Formatter("%(message)s"))
    logger = logging.getLogger("llmserve.requests")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _long(request_id: str, **options: object) -> pb.GenerateRequest:
    return build_request("Once upon a time", max_new_tokens=1000, ignore_eos=True, request_id=request_id, **options)


def test_ok_and_client_cancels(server: ServerThread, lines: _Lines) -> None:
    rng = random.Random(13)
    with Client(server.address, timeout=60) as client:
        list(client.generate("hi", max_new_tokens=3, request_id="done-1"))
        assert "status=OK finish=length" in lines.find("done-1")
        for i in range(30):
            call = client._stub.Generate(_long(f"cancel-{i}"), timeout=60)
            for _ in range(rng.randrange(1, 6)):
                next(call)
            call.cancel()
        assert wait_until(lambda: server.server.servicer.num_streams == 0, timeout=10)
    for i in range(30):
        assert " status=CANCELLED finish=cancelled " in lines.find(f"cancel-{i}")
    assert not [line for line in lines.lines if "UNKNOWN" in line]


def test_deadlines_are_deadline_exceeded_in_the_log_and_for_the_client(server: ServerThread, lines: _Lines) -> None:
    with Client(server.address) as client:
        # Every deadline well before the stream's end: the tiny model streams its 1,000 tokens in ~1 s on a fast CPU.
        for i, timeout in enumerate([0.2, 0.3, 0.4, 0.5]):
            received = []
            with pytest.raises(grpc.RpcError) as err:
                for response in client.generate(_long(f"late-{i}"), timeout=timeout):
                    received.append(response)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The server ends the call just before the deadline, so the last message usually arrives.
            if received and received[-1].finish_reason:
                assert received[-1].finish_reason == pb.FINISH_REASON_DEADLINE
                assert received[-1].usage.completion_tokens > 0
        assert wait_until(lambda: server.server.servicer.num_streams == 0, timeout=10)
    for i in range(4):
        assert " status=DEADLINE_EXCEEDED finish=deadline " in lines.find(f"late-{i}")


def test_streams_cut_by_shutdown_get_a_last_message_and_unavailable(lines: _Lines) -> None:
    srv = ServerThread(tiny_engine()).start()
    with Client(srv.address, timeout=60) as client:
        calls = [client._stub.Generate(_long(f"cut-{i}"), timeout=60) for i in range(2)]
        received: list[list[pb.GenerateResponse]] = [[next(call)] for call in calls]
        errors: list[grpc.RpcError] = []

        def read(call: grpc.Call, into: list[pb.GenerateResponse]) -> None:
            try:
                for response in call:
                    into.append(response)
            except grpc.RpcError as err:
                errors.append(err)

        readers = [threading.Thread(target=read, args=pair) for pair in zip(calls, received, strict=True)]
        for reader in readers:
            reader.start()
        srv.stop(grace_s=0.2)
        for reader in readers:
            reader.join(timeout=30)
    assert [err.code() for err in errors] == [grpc.StatusCode.UNAVAILABLE] * 2
    for i, messages in enumerate(received):
        last = messages[-1]
        assert last.finish_reason == pb.FINISH_REASON_CANCELLED
        assert 0 < last.usage.completion_tokens < 1000
        assert last.usage.prompt_tokens > 0
        assert f"finish=cancelled prompt_tokens={last.usage.prompt_tokens} " in lines.find(f"cut-{i}")
        assert " status=UNAVAILABLE " in lines.find(f"cut-{i}")


FORGERY = 'x status=OK\n2026-01-01 00:00:00,000 INFO llmserve.requests: request_id=forged status=OK "'


def test_no_caller_can_forge_a_line(server: ServerThread, lines: _Lines) -> None:
    with Client(server.address, timeout=60) as client:
        with pytest.raises(grpc.RpcError):
            list(client.generate("hi", max_new_tokens=2, request_id=FORGERY))
        # Printable but log-hostile: spaces, quotes, equals signs, non-ASCII.
        tricky = 'a b="c" request_id=forged é'
        list(client.generate("hi", max_new_tokens=2, request_id=tricky))
    # Every line reads back as the fields the server wrote, the caller's values intact inside their quotes.
    parsed = [_parse(line) for line in lines.lines]
    assert [fields["request_id"] for fields in parsed if fields["status"] == "INVALID_ARGUMENT"][-1] == FORGERY
    assert [fields["status"] for fields in parsed if fields["request_id"] == tricky] == ["OK"]
    assert not [fields for fields in parsed if fields["request_id"] == "forged"]
    assert lines.find(tricky).startswith('request_id="a b=\\"c\\" request_id=forged \\u00e9" status=OK ')


_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^ "]+)(?: |$)')


def _parse(line: str) -> dict[str, str]:
    """A logfmt line back into its fields; fails on anything that is not key=value pairs."""
    assert "\n" not in line
    fields, at = {}, 0
    while at < len(line):
        match = _FIELD.match(line, at)
        assert match, line[at:]
        key, value = match.groups()
        assert key not in fields, line
        fields[key] = json.loads(value) if value.startswith('"') else value
        at = match.end()
    return fields


def test_json_log_lines(server: ServerThread) -> None:
    handler = _Lines(JsonFormatter())
    logger = logging.getLogger("llmserve.requests")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with Client(server.address, timeout=60) as client:
            list(client.generate("hi", max_new_tokens=2, request_id="json-1"))
            with pytest.raises(grpc.RpcError):
                list(client.generate("hi", max_new_tokens=2, request_id=FORGERY))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    records = [json.loads(line) for line in handler.lines]
    assert all("\n" not in line for line in handler.lines)
    ok = next(r for r in records if r["request_id"] == "json-1")
    assert (ok["status"], ok["finish"], ok["completion_tokens"]) == ("OK", "length", 2)
    assert ok["logger"] == "llmserve.requests"
    assert next(r for r in records if r["request_id"] == FORGERY)["status"] == "INVALID_ARGUMENT"


def test_a_call_cut_at_its_deadline_while_the_engine_is_busy_is_logged_deadline_exceeded(lines: _Lines) -> None:
    """gRPC cancels the handler when the deadline passes before the engine ends the request (here a step takes 2 s):
    the log says DEADLINE_EXCEEDED, as the client saw, not CANCELLED."""
    request = build_request("hi", max_new_tokens=3, request_id="slow-late")
    code, line = _one_failing_call(FakeEngine(step_s=2.0), request, 0.5, lines)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert " status=DEADLINE_EXCEEDED finish=deadline " in line


def _one_failing_call(
    engine: FakeEngine, request: pb.GenerateRequest, timeout: float, lines: _Lines
) -> tuple[grpc.StatusCode, str]:
    """Serve `engine`, make one call that must fail; its status code and its log line."""
    srv = ServerThread(engine).start()
    try:
        with Client(srv.address) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate(request, timeout=timeout))
        assert wait_until(lambda: srv.server.servicer.num_streams == 0, timeout=10)
        return err.value.code(), lines.find(request.request_id)
    finally:
        srv.stop()


def test_the_engine_gets_the_calls_deadline_and_the_log_its_prompt_when_asked(lines: _Lines) -> None:
    """The engine request carries the call's deadline (a margin early); --log-prompts logs the input; a call refused
    before it had a request id is logged as request_id=-."""
    seen: list[float | None] = []

    class Recording(FakeEngine):
        async def generate(self, request):
            seen.append(request.deadline)
            async for delta in super().generate(request):
                yield delta

    srv = ServerThread(Recording(), log_prompts=True).start()
    try:
        with Client(srv.address) as client:
            before = time.monotonic()
            client.generate_text("a prompt to log", max_new_tokens=2, request_id="logged", timeout=30)
            with pytest.raises(grpc.RpcError):
                list(client.generate(build_request("hi", stop=["x"] * 17), timeout=30))  # no id; refused by the limits
        assert len(seen) == 1 and before + 29 < seen[0] < time.monotonic() + 30  # the refused one never got there
        assert 'prompt="a prompt to log"' in lines.find("logged")
        assert any(line.startswith("request_id=- status=INVALID_ARGUMENT ") for line in lines.lines), lines.lines[-3:]
    finally:
        srv.stop()


def test_an_unexpected_failure_is_logged_by_its_type(lines: _Lines) -> None:
    """An exception no gRPC status stands for (a fault in the engine) reaches the client as UNKNOWN and the log
    names its type."""

    class Faulty(FakeEngine):
        async def generate(self, request):
            raise RuntimeError("a fault in the books")
            yield  # an async generator, as the engine's

    code, line = _one_failing_call(Faulty(), build_request("hi", max_new_tokens=2, request_id="faulty"), 30, lines)
    assert code == grpc.StatusCode.UNKNOWN
    assert " status=RuntimeError " in line
