"""The step loop driven by hand (no thread): books, counters, failures, and the paths a live engine rarely takes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore, ThreadCore
from llmserve.engine.types.errors import InvalidRequest
from llmserve.engine.types.outputs import FinishReason, Usage
from llmserve.engine.types.request import SamplingParams, StoppingParams, validate
from llmserve.models.loader import from_config
from tests.engine.engine_helpers import RUN_TIMEOUT_S, PieceTokenizer, req, serve, stepped_core, with_text
from tests.testing import tiny_config


def test_context_is_capped_at_a_sliding_window() -> None:
    config = tiny_config("mistral", vocab_size=64, max_positions=4096, sliding_window=256)
    core = EngineCore(from_config(config), EngineConfig(kv_cache_tokens=1024))
    assert core.max_model_len == 256
    with pytest.raises(InvalidRequest):
        validate(req("long", [1] * 300, max_new=4), core.facts)


def test_stats_read_the_books() -> None:
    core = stepped_core()
    pool = core.pool
    empty = core.stats()
    assert (empty.running, empty.waiting, empty.kv_blocks_used, empty.kv_blocks_cached) == (0, 0, 0, 0)
    assert (empty.kv_blocks_total, empty.block_size) == (pool.num_blocks, 16)
    serve(core, req("s", list(range(3, 40)), max_new=4, session_id="conv"))  # 40 tokens computed: 3 blocks
    serve(core, req("p", list(range(3, 40)), max_new=2))  # no session: reuses the 2 full blocks cached by "s"
    stats = core.stats()
    assert (stats.sessions, stats.session_blocks, stats.kv_blocks_used) == (1, 3, 3)
    assert stats.kv_blocks_cached == pool.num_cached and pool.num_free == pool.num_blocks - 3
    assert (stats.session_hits, stats.session_misses, stats.prefix_cache_hits) == (0, 1, 1)
    assert stats.session_evictions == {"memory": 0, "limit": 0, "ttl": 0}
    assert stats.session_evictions is not core.sessions.evictions  # a snapshot, not the live dict
    client = ThreadCore(core)  # counts what it added, the inbox too, as the front end sees it
    client.add(req("w", [1, 2, 3]))
    assert client.stats().waiting == 1 and client.num_waiting == 1 and core.stats().waiting == 0  # in the inbox
    core.drain_inbox()
    assert client.stats().waiting == 1 and core.stats().waiting == core.scheduler.num_waiting == 1  # queued
    core.step()
    stats = client.stats()
    assert (stats.running, stats.waiting, stats.preemptions) == (1, 0, 0) and client.num_running == 1


def ask(core: EngineCore, session_id: str, *, delete: bool = False) -> object:
    """A session command through the inbox, answered when this thread drains it (it is the step thread here)."""
    reply = core.delete_session(session_id) if delete else core.get_session(session_id)
    assert not reply.done()  # only the thread that owns the books answers
    core.drain_inbox()
    return reply.result(timeout=0)


def test_sessions_are_read_and_deleted_through_the_inbox() -> None:
    core = stepped_core()
    assert ask(core, "conv") is None and ask(core, "conv", delete=True) is False
    timing = serve(core, req("s", list(range(3, 20)), max_new=3, session_id="conv"))[-1].timing
    assert core.steps == 3 and timing.ttft_s < timing.total_s < 60  # the first token came a step before the last
    info = ask(core, "conv")
    assert (info.session_id, info.cached_tokens) == ("conv", 19) and abs(info.last_used - time.time()) < 60
    assert ask(core, "conv", delete=True) is True and ask(core, "conv") is None


def test_only_consecutive_failed_steps_kill_the_engine() -> None:
    core = stepped_core()
    real = core.backend.execute
    failing = [True, True, False, True, True]  # two in a row, a success, two again: never three in a row

    def flaky(plan):  # noqa: ANN001, ANN202
        if failing.pop(0) if failing else False:
            raise RuntimeError("boom")
        return real(plan)

    core.backend.execute = flaky
    reasons = [serve(core, req(f"r{i}", [1, 2, 3], max_new=1))[-1].finish_reason for i in range(5)]
    error, length = FinishReason.ERROR, FinishReason.LENGTH
    assert reasons == [error, error, length, error, error]
    assert core.dead_reason is None and core._failures == 2 and core.steps == 1
    core.backend.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("gone"))  # noqa: ARG005
    final = serve(core, req("last", [1, 2, 3]))[-1]
    assert final.finish_reason is FinishReason.ERROR and "gone" in final.error
    assert core.dead_reason == "3 consecutive failed steps, last: RuntimeError: gone"


def test_a_request_that_reaches_a_dead_engine_gets_its_error() -> None:
    core = stepped_core()
    core.dead_reason = "device lost"
    deltas = serve(core, req("late", [1, 2, 3, 4]))
    assert len(deltas) == 1 and deltas[0].token_ids == [] and deltas[0].error == "device lost"
    assert deltas[0].request_id == "late"
    assert deltas[0].finish_reason is FinishReason.ERROR and deltas[0].usage == Usage(4, 0, 0)
    assert deltas[0].timing is not None and deltas[0].timing.total_s >= 0
    assert core.stats().waiting == 0 and not core.scheduler.has_work


def test_an_engine_that_is_stopped_cancels_what_is_left() -> None:
    core = stepped_core()
    outputs: list = []
    core.submit(req("left", [1, 2, 3], max_new=50))
    stop = threading.Event()
    stop.set()
    core.run(stop, outputs.extend)  # drains the inbox, steps no more
    assert [o.finish_reason for o in outputs] == [FinishReason.CANCELLED] and core.num_running == 0


def test_seeds_the_engine_draws_can_be_sent_back() -> None:
    core = stepped_core()
    seeds = [
        serve(core, req(f"s{i}", [1, 2], max_new=1, sampling=SamplingParams(temperature=1.0)))[-1].seed
        for i in range(16)
    ]
    for seed in seeds:
        SamplingParams(temperature=1.0, seed=seed).validate()  # in [0, 2**63)
    assert len(set(seeds)) == 16


def test_eos_ends_a_request_unless_it_ignores_eos_and_prefix_caching_can_be_off() -> None:
    core = stepped_core(enable_prefix_caching=False)
    greedy = [t for d in serve(core, req("g", list(range(3, 40)), max_new=4)) for t in d.token_ids]
    core.loaded.eos_token_ids = (greedy[0],)
    ignoring = serve(core, req("ignore", list(range(3, 40)), max_new=4))  # req() sets ignore_eos
    assert [t for d in ignoring for t in d.token_ids] == greedy and ignoring[-1].finish_reason is FinishReason.LENGTH
    assert ignoring[-1].usage.cached_prompt_tokens == 0  # no prefix cache: two full blocks computed again
    ending = serve(core, req("eos", list(range(3, 40)), stopping=StoppingParams(max_new_tokens=4)))
    assert [t for d in ending for t in d.token_ids] == greedy[:1] and ending[-1].finish_reason is FinishReason.EOS


def test_a_dying_engine_fails_the_requests_still_waiting() -> None:
    core = stepped_core(max_num_seqs=1)
    core.backend.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("gone"))  # noqa: ARG005
    for i in range(4):
        core.submit(req(f"r{i}", [1, 2, 3]))
    core.drain_inbox()
    for _ in range(3):  # one running request per step: the third failure kills the engine
        core.step()
    finals = {out.request_id: out for out in core.take_outputs()}
    assert core.dead_reason == "3 consecutive failed steps, last: RuntimeError: gone"
    waiting = finals["r3"]
    assert waiting.finish_reason is FinishReason.ERROR and waiting.error == core.dead_reason
    assert all(finals[f"r{i}"].error == "RuntimeError: gone" for i in range(3))
    assert core.num_running == 0 and not core.scheduler.has_work


def test_text_and_stop_sequences_in_the_deltas() -> None:
    core = stepped_core()
    untitled = serve(core, req("no-tokenizer", [5, 6, 7], max_new=3))  # a model without a tokenizer: ids only
    assert [d.text for d in untitled] == ["", "", ""] and all(d.logprobs is None for d in untitled)
    greedy, _, text = with_text(core, [5, 6, 7], 8)
    deltas = serve(core, req("plain", [5, 6, 7], max_new=8))
    assert [d.text for d in deltas] == list(text) and deltas[-1].finish_reason is FinishReason.LENGTH
    assert {d.request_id for d in deltas} == {"plain"}
    stop = text[3:5]
    cut = text.find(stop)
    deltas = serve(core, req("stop", [5, 6, 7], stopping=StoppingParams(8, stop_sequences=(stop,), ignore_eos=True)))
    assert "".join(d.text for d in deltas) == text[:cut] and deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert [t for d in deltas for t in d.token_ids] == greedy[: cut + 2]
    stopping = StoppingParams(8, stop_sequences=(stop,), include_stop_sequence=True, ignore_eos=True)
    deltas = serve(core, req("with-stop", [5, 6, 7], stopping=stopping))
    assert "".join(d.text for d in deltas) == text[: cut + 2]
    # A stop that never completes holds back the last letter; the final delta flushes it.
    never = text[-1] + "#"
    deltas = serve(core, req("held", [5, 6, 7], stopping=StoppingParams(8, stop_sequences=(never,), ignore_eos=True)))
    assert "".join(d.text for d in deltas) == text and deltas[-1].finish_reason is FinishReason.LENGTH
    assert deltas[-1].text.endswith(text[-1])


def test_a_stop_completed_by_the_flushed_tail_ends_as_a_stop_sequence() -> None:
    core = stepped_core()
    # A prompt whose first two greedy tokens differ (the tiny model repeats itself after some).
    prompt = next(p for p in ([i, i + 1, i + 2] for i in range(1, 200, 7)) if len(set(with_text(core, p, 2)[0])) == 2)
    greedy, pieces, _ = with_text(core, prompt, 2)
    pieces[greedy[0]], pieces[greedy[1]] = b"xa", b"b\xc3"  # "b" comes with half a character: held back
    stopping = StoppingParams(2, stop_sequences=("ab",), ignore_eos=True)
    deltas = serve(core, req("tail", prompt, stopping=stopping))
    assert "".join(d.text for d in deltas) == "x" and deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE


def test_the_loaded_tokenizer_is_used_and_a_far_deadline_does_not_end_a_request() -> None:
    loaded = from_config(tiny_config(max_positions=512), dtype=torch.float32)
    loaded.tokenizer = PieceTokenizer({})  # every id reads "?"
    core = EngineCore(loaded, EngineConfig(block_size=16, kv_cache_tokens=1024))
    deltas = serve(core, req("far", [1, 2, 3], max_new=3, deadline=time.monotonic() + 3600))
    assert "".join(d.text for d in deltas) == "???" and deltas[-1].finish_reason is FinishReason.LENGTH


def test_a_failed_forward_leaves_no_session_behind() -> None:
    core = stepped_core()
    real, calls = core.backend.execute, []

    def second_fails(plan):  # noqa: ANN001, ANN202
        calls.append(plan)
        if len(calls) == 2:  # after the prompt was computed
            raise RuntimeError("boom")
        return real(plan)

    core.backend.execute = second_fails
    final = serve(core, req("failed", list(range(3, 40)), session_id="conv"))[-1]
    assert final.finish_reason is FinishReason.ERROR and final.usage.completion_tokens == 1
    assert ask(core, "conv") is None
    assert core.pool.num_free == core.pool.num_blocks


def test_a_fault_in_the_books_fails_the_requests_instead_of_hanging_them() -> None:
    """An exception outside the forward (here the scheduler's) must not end the step thread silently, with every
    caller waiting forever and the engine still looking alive: the engine dies and says why."""
    core = stepped_core()
    finals: dict[str, object] = {}
    core.submit(req("caught", [1, 2, 3], max_new=50))

    def emit(outputs: list) -> None:
        finals.update((out.request_id, out) for out in outputs if out.finished)

    def broken() -> None:
        raise RuntimeError("books out of balance")

    core.scheduler.schedule = broken
    stop = threading.Event()
    thread = threading.Thread(target=core.run, args=(stop, emit), daemon=True)
    thread.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while "caught" not in finals and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    core.wake()
    thread.join(RUN_TIMEOUT_S)
    final = finals["caught"]
    assert final.finish_reason is FinishReason.ERROR and "books out of balance" in final.error
    assert core.dead_reason == "engine step failed: RuntimeError: books out of balance" and not thread.is_alive()


SAMPLED = SamplingParams(temperature=1.0, seed=1234)


def _sampled_tokens(core: EngineCore, *, preempt_at: int | None = None, restart: bool = False) -> list[int]:
    """A seeded sampled request stepped to its end; preempted once it has `preempt_at` tokens (its stream dropped
    too when `restart`: what a sampler that started streams afresh on recompute would do)."""
    handle = core.submit(req("sampled", list(range(3, 40)), max_new=24, sampling=SAMPLED))
    core.drain_inbox()
    tokens: list[int] = []
    for _ in range(200):
        core.step()
        for out in core.take_outputs():
            tokens.extend(out.token_ids)
            if out.finished:
                return tokens
        seq = core.scheduler.live[handle]
        if len(tokens) == preempt_at and seq.num_preemptions == 0:
            core.scheduler.preempt(seq)  # its blocks freed: it recomputes prompt and tokens, then samples on
            assert handle in core.backend.paged.states.streams  # the stream stays while the sequence lives
            if restart:
                core.backend.paged.states.streams.release(handle)
    raise AssertionError("no final output")


def test_a_preempted_sampled_request_goes_on_with_its_random_stream() -> None:
    never = _sampled_tokens(stepped_core())
    core = stepped_core()
    preempted = _sampled_tokens(core, preempt_at=10)
    assert core.scheduler.num_preemptions == 1 and preempted == never
    assert _sampled_tokens(stepped_core(), preempt_at=10, restart=True) != never  # the check can tell


def test_no_random_stream_outlives_its_request() -> None:
    """Finished, aborted, failed with its step, or cancelled when the engine stops: the backend's sampler holds
    no stream once every request has ended (a greedy request never holds one)."""
    core = stepped_core()
    streams = core.backend.paged.states.streams
    for i in range(3):
        serve(core, req(f"done{i}", [1, 2, 3], max_new=4, sampling=SamplingParams(temperature=0.8)))
    serve(core, req("greedy", [1, 2, 3], max_new=4))
    assert len(streams) == 0

    aborted = core.submit(req("aborted", [1, 2, 3], max_new=50, sampling=SAMPLED))
    kept = core.submit(req("kept", [4, 5, 6], max_new=50, sampling=SAMPLED))
    core.drain_inbox()
    for _ in range(3):
        core.step()
    assert len(streams) == 2
    core.abort(aborted)
    core.drain_inbox()
    assert aborted not in streams and kept in streams

    real = core.backend.execute
    core.backend.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("boom"))  # noqa: ARG005
    core.step()
    assert core.take_outputs()[-1].error == "RuntimeError: boom" and len(streams) == 0

    core.backend.execute = real
    core.submit(req("left", [1, 2, 3], max_new=50, sampling=SAMPLED))
    core.drain_inbox()
    core.step()
    assert len(streams) == 1
    stop = threading.Event()
    stop.set()
    core.run(stop, lambda outputs: None)  # stops at once: cancels what is left
    assert len(streams) == 0


def test_a_dying_engine_drops_every_random_stream() -> None:
    core = stepped_core()
    for i in range(2):
        core.submit(req(f"r{i}", [1, 2, 3 + i], max_new=50, sampling=SamplingParams(temperature=1.0)))
    core.drain_inbox()
    for _ in range(3):
        core.step()
    assert len(core.backend.paged.states.streams) == 2

    def broken() -> None:
        raise RuntimeError("books out of balance")

    core.scheduler.schedule = broken
    stop = threading.Event()
    core.run(stop, lambda outputs: stop.set())  # the fault kills the engine, whose final outputs stop the loop
    assert core.dead_reason is not None and len(core.backend.paged.states.streams) == 0


def test_an_encoders_pooling_input_may_hold_all_its_positions() -> None:
    """A decoder's pooling input leaves a position free, as any of its prompts; an encoder generates nothing after
    its input, which may take all its positions (sentence-transformers reads 512-token pairs on a 512-position BERT),
    within the step's budget and the folder's max_seq_length."""
    from types import SimpleNamespace

    from llmserve.engine.core.engine_core import pooling_limit

    def loaded(encoder: bool, max_seq_length: int | None = None) -> Any:
        return SimpleNamespace(encoder=encoder, pooling=SimpleNamespace(max_seq_length=max_seq_length))

    assert pooling_limit(loaded(True), 512, 1024) == 512
    assert pooling_limit(loaded(True), 512, 256) == 256
    assert pooling_limit(loaded(True, 128), 512, 1024) == 128
    assert pooling_limit(loaded(False), 512, 1024) == 511
