"""The front end's output processor on outputs built by hand: text, stop strings and who ends a request.

The engine-driven cases (real core, real steps) are in test_core.py; here each rule is pinned on its own.
"""

from __future__ import annotations

from llmserve.engine.frontend.output_processor import OutputProcessor
from llmserve.engine.types.outputs import Delta, EngineOutput, FinishReason, RequestStart, Timing, Usage
from llmserve.engine.types.request import GenerationRequest, StoppingParams

START = RequestStart(num_prompt=3, num_cached_prompt=1, seed=7, arrival=0.0, queued_s=0.01, ttft_s=0.02)


class Letters:
    """Token id i reads as the i-th lowercase letter."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in token_ids)


def request(*stops: str) -> GenerationRequest:
    return GenerationRequest("r", (1, 2, 3), stopping=StoppingParams(10, stop_sequences=stops))


def token(i: int, *, first: bool = False, reason: FinishReason | None = None) -> EngineOutput:
    out = EngineOutput(1, "r", [i], start=START if first else None, finish_reason=reason)
    if reason is not None:
        out.usage, out.timing, out.seed = Usage(3, 1, 99), Timing(0.1, 0.2, 0.3), 7
    return out


def routed(*stops: str, tokenizer: object = None) -> tuple[OutputProcessor, list[Delta]]:
    processor = OutputProcessor(Letters() if tokenizer is None else tokenizer)
    deltas: list[Delta] = []
    processor.add(1, request(*stops), deltas.append)
    return processor, deltas


def test_text_follows_the_tokens_and_the_cores_final_accounts_pass_through() -> None:
    processor, deltas = routed()
    assert processor.process([token(0, first=True), token(1)]) == []
    assert processor.process([token(2, reason=FinishReason.EOS)]) == []
    assert [d.text for d in deltas] == ["a", "b", "c"] and [d.token_ids for d in deltas] == [[0], [1], [2]]
    final = deltas[-1]
    assert final.finish_reason is FinishReason.EOS and final.usage == Usage(3, 1, 99) and final.seed == 7
    assert final.timing == Timing(0.1, 0.2, 0.3) and len(processor) == 0


def test_a_stop_string_ends_the_stream_here_and_asks_the_core_to_keep_the_tokens_sent() -> None:
    processor, deltas = routed("cd")
    processor.process([token(0, first=True), token(2)])
    stops = processor.process([token(3), token(4)])  # "cd" completes at the third token; the fourth is dropped
    assert stops == [(1, 3)]
    assert "".join(d.text for d in deltas) == "a" and [t for d in deltas for t in d.token_ids] == [0, 2, 3]
    final = deltas[-1]
    assert final.finish_reason is FinishReason.STOP_SEQUENCE and final.usage == Usage(3, 1, 3)
    assert final.seed == 7 and final.timing.queue_s == 0.01 and final.timing.ttft_s == 0.02
    assert processor.process([EngineOutput(1, "r", [], finish_reason=FinishReason.STOP_SEQUENCE)]) == []
    assert len(deltas) == 3 and len(processor) == 0  # the core's own final for it is dropped


def test_a_stop_on_the_cores_last_token_needs_no_stop_and_a_held_tail_is_flushed() -> None:
    processor, deltas = routed("bc")
    processor.process([token(0, first=True)])
    assert processor.process([token(1), token(2, reason=FinishReason.LENGTH)]) == []
    assert "".join(d.text for d in deltas) == "a" and deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert deltas[-1].usage == Usage(3, 1, 99)  # the core's accounts: it ended the request itself
    processor, deltas = routed("cz")
    processor.process([token(0, first=True), token(2)])  # "c" is held back: it may start "cz"
    assert "".join(d.text for d in deltas) == "a"
    processor.process([token(3, reason=FinishReason.LENGTH)])
    assert "".join(d.text for d in deltas) == "acd" and deltas[-1].finish_reason is FinishReason.LENGTH


def test_a_cancelled_request_flushes_nothing_and_a_discarded_one_hears_nothing() -> None:
    processor, deltas = routed("cz")
    processor.process([token(2, first=True), EngineOutput(1, "r", [], finish_reason=FinishReason.CANCELLED)])
    assert [d.text for d in deltas] == ["", ""] and deltas[-1].finish_reason is FinishReason.CANCELLED
    processor, deltas = routed()
    processor.discard(1)
    processor.discard(1)  # twice: harmless
    assert processor.process([token(0, first=True)]) == [] and deltas == []


def test_a_failing_tokenizer_fails_its_request_alone_and_stops_it_in_the_core() -> None:
    class Broken:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            if 5 in token_ids:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")
            return "x" * len(token_ids)

    processor = OutputProcessor(Broken())
    mine: list[Delta] = []
    other: list[Delta] = []
    processor.add(1, request(), mine.append)
    processor.add(2, request(), other.append)
    stops = processor.process([token(0, first=True), EngineOutput(2, "o", [1], start=START), token(5)])
    assert stops == [(1, None)]
    assert mine[-1].finish_reason is FinishReason.ERROR and mine[-1].error.startswith("UnicodeDecodeError")
    assert mine[-1].usage == Usage(3, 1, 2) and other[-1].text == "x" and not other[-1].finished
    assert len(processor) == 1


def test_without_a_tokenizer_deltas_carry_ids_only() -> None:
    processor = OutputProcessor(None)
    deltas: list[Delta] = []
    processor.add(1, request("ab"), deltas.append)
    processor.process([token(0, first=True), token(1, reason=FinishReason.LENGTH)])
    assert [d.text for d in deltas] == ["", ""] and deltas[-1].finish_reason is FinishReason.LENGTH
