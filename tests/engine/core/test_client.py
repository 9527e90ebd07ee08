"""The books a core's client keeps (core/client.py's ClientRequests): handles numbered from 1 by the client, each
request forgotten at its final output, and the one formula of the waiting count (added, not ended, not running).
Both clients over a real core: core/test_engine_process.py and frontend/test_async_engine.py."""

from __future__ import annotations

from llmserve.engine.core.client import ClientRequests
from llmserve.engine.types.outputs import EngineOutput, FinishReason
from llmserve.engine.types.protocol import EngineStats


def stats(running: int, waiting: int) -> EngineStats:
    return EngineStats(running, waiting, 8, 0, 0, 16, 0, 0, 0, 0, 0, {}, 0)


def test_handles_are_numbered_from_one_and_requests_end_at_their_final_output() -> None:
    books: ClientRequests[str] = ClientRequests()
    assert [books.add(name) for name in "abc"] == [1, 2, 3]
    books.end([EngineOutput(1, "a", [5]), EngineOutput(2, "b", [], finish_reason=FinishReason.EOS)])
    assert len(books) == 2 and books.get(1) == "a" and books.get(2) is None
    books.discard(3)
    assert books.take_all() == {1: "a"} and len(books) == 0
    assert books.add("d") == 4  # never reused


def test_waiting_is_added_not_ended_not_running_in_the_stats_too() -> None:
    books: ClientRequests[str] = ClientRequests()
    for name in "abcd":
        books.add(name)
    assert books.waiting(running=1) == 3 and books.waiting(running=9) == 0
    # The core counts what it holds; the client also what is on its way to the core.
    assert books.stats(stats(running=1, waiting=0)).waiting == 3
