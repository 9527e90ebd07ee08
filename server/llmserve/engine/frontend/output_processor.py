"""The front end's output processor: the core's token outputs in, the caller's deltas out.

It does a request's text work away from the step thread, so that the thread that feeds the device never
waits on it: incremental detokenization, stop strings, and the accounts of a request that a stop string ended.
It runs wherever the front end runs (the event loop, in the server), once per step for all of that step's
outputs. A stop string found in a request's text ends that request's stream at
once; `process` returns it so that the front end tells the core to stop it too (`Core.abort` with the number
of tokens the caller was sent), and any token the core produced meanwhile is dropped here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.engine.frontend.detokenizer import Decoder, IncrementalDetokenizer
from llmserve.engine.types.outputs import Delta, EngineOutput, FinishReason, RequestStart
from llmserve.engine.types.request import GenerationRequest

log = logging.getLogger(__name__)

# Finishes the core decides on a token: the text still held back is flushed with that token's delta.
_FLUSHING = frozenset({FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.LENGTH, FinishReason.CONSTRAINT})


@dataclass(slots=True, eq=False)
class _Stream:
    """One request's state on the front end side."""

    request_id: str
    detok: IncrementalDetokenizer | None
    deliver: Callable[[Delta], None]
    start: RequestStart | None = None
    num_generated: int = 0
    index: int = 0  # the completion of an n > 1 request it is


class OutputProcessor:
    """Turns EngineOutputs into Deltas for the requests `add` registered. Not thread-safe: one thread calls it."""

    def __init__(self, tokenizer: Decoder | None) -> None:  # a transformers tokenizer, or None: token ids only
        self.tokenizer = tokenizer
        self._streams: dict[int, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, handle: int, request: GenerationRequest, deliver: Callable[[Delta], None], index: int = 0) -> None:
        """Route the outputs of `handle` (Core.add's) as deltas to `deliver`, each tagged with `index`."""
        detok = None
        if self.tokenizer is not None:
            stopping = request.stopping
            detok = IncrementalDetokenizer(self.tokenizer, stopping.stop_sequences, stopping.include_stop_sequence)
        self._streams[handle] = _Stream(request.request_id, detok, deliver, index=index)

    def discard(self, handle: int) -> None:
        """Forget a request whose caller went away; its later outputs are dropped."""
        self._streams.pop(handle, None)

    def process(self, outputs: list[EngineOutput]) -> list[tuple[int, int | None]]:
        """Deliver each output's delta; returns (handle, tokens kept or None) for every request the processor
        ended itself, which the core must stop (Core.abort)."""
        stops: list[tuple[int, int | None]] = []
        for output in outputs:
            stream = self._streams.get(output.handle)
            if stream is None:
                continue  # ended here already, or never routed (the warm-up)
            try:
                delta, stopped = self._delta(stream, output)
            except Exception as exc:  # its detokenizer or stop strings: that request's failure alone
                log.exception("request %r failed after its forward", stream.request_id)
                delta = self._final(stream, Delta(stream.request_id, [], index=stream.index), FinishReason.ERROR)
                delta.error = f"{type(exc).__name__}: {exc}"
                stopped = not output.finished
                if stopped:
                    stops.append((output.handle, None))
            else:
                if stopped:
                    stops.append((output.handle, stream.num_generated))
            if delta.finished:
                del self._streams[output.handle]
            stream.deliver(delta)
        return stops

    def _delta(self, stream: _Stream, output: EngineOutput) -> tuple[Delta, bool]:
        """The caller's delta for one output, and whether a stop string ended the request before the core did."""
        if output.start is not None:
            stream.start = output.start
        stream.num_generated += len(output.token_ids)
        delta = Delta(stream.request_id, output.token_ids, "", output.logprobs, index=stream.index)
        delta.prompt_logprobs = output.prompt_logprobs
        reason = output.finish_reason
        detok = stream.detok
        if detok is not None and output.token_ids:
            pushed = detok.push(output.token_ids)
            delta.text = pushed.text
            if pushed.stop_sequence is not None and reason in (None, FinishReason.LENGTH):
                delta.matched_stop = pushed.stop_sequence
                if reason is None:
                    return self._final(stream, delta, FinishReason.STOP_SEQUENCE), True
                reason = FinishReason.STOP_SEQUENCE
            elif reason in _FLUSHING:
                delta.text += detok.flush()
                if detok.stopped_on is not None:  # the held-back tail completed a stop string
                    reason = FinishReason.STOP_SEQUENCE
                    delta.matched_stop = detok.stopped_on
        if reason is not None:
            delta.finish_reason = reason
            delta.usage, delta.timing, delta.seed, delta.error = output.usage, output.timing, output.seed, output.error
            delta.embedding = output.embedding
        return delta, False

    def _final(self, stream: _Stream, delta: Delta, reason: FinishReason) -> Delta:
        """End a request here: its accounts as they stand at the tokens the caller was sent."""
        start = stream.start
        delta.finish_reason = reason
        if start is not None:
            delta.usage, delta.timing = start.usage(stream.num_generated), start.timing(time.monotonic())
            delta.seed = start.seed
        return delta
