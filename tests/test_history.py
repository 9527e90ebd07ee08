"""The session history store (server/llmserve/history.py): pure book-keeping, no model, no gRPC."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmserve.engine.request import Delta, FinishReason, InvalidRequest
from llmserve.history import HistoryBusy, HistoryConfig, HistoryInput, HistoryStore, NoHistory, Turn


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def finish(turn: Turn, ids: list[int], text: str = "", reason: FinishReason = FinishReason.EOS) -> None:
    """Feed the turn an answer the way the servicer does: deltas, the last one with a finish reason."""
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        turn.observe(Delta("r", [token], text if last else "", finish_reason=reason if last else None))
    turn.release()


def tokens_turn(store: HistoryStore, key: str, prompt: list[int], answer: list[int], continues: bool = False) -> None:
    turn = store.start(key, f"req-{key}", continues=continues)
    ids = store.continue_tokens(turn, prompt, "token_ids") if continues else prompt
    turn.begin(HistoryInput.TOKENS, ids)
    finish(turn, answer)


def test_tokens_history_is_prompt_then_answer_and_continuing_appends() -> None:
    store = HistoryStore(HistoryConfig(), max_tokens=1000)
    tokens_turn(store, "s", [1, 2, 3], [4, 5])
    held = store.get("s")
    assert held is not None and list(held.token_ids) == [1, 2, 3, 4, 5] and held.turns == 1
    tokens_turn(store, "s", [6], [7], continues=True)
    held = store.get("s")
    assert list(held.token_ids) == [1, 2, 3, 4, 5, 6, 7] and held.turns == 2


def test_chat_history_holds_the_answer_as_an_assistant_message() -> None:
    store = HistoryStore(HistoryConfig(), max_tokens=1000)
    turn = store.start("c", "r1", continues=False)
    turn.begin(HistoryInput.CHAT, [10, 11], [("system", "Be brief."), ("user", "Hi")])
    finish(turn, [12, 13], text="Hello!")
    turn = store.start("c", "r2", continues=True)
    composed = store.continue_chat(turn, [("user", "Bye")])
    assert composed == [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]
    assert store.get("c").turns == 1


def test_kinds_do_not_mix() -> None:
    store = HistoryStore(HistoryConfig(), max_tokens=1000)
    tokens_turn(store, "t", [1], [2])
    with pytest.raises(InvalidRequest) as err:
        store.continue_chat(store.start("t", "r", continues=True), [("user", "x")])
    assert err.value.field == "chat"
    turn = store.start("c", "r", continues=False)
    turn.begin(HistoryInput.CHAT, [1], [("user", "x")])
    finish(turn, [2])
    with pytest.raises(InvalidRequest) as err:
        store.continue_tokens(store.start("c", "r2", continues=True), [3], "text")
    assert err.value.field == "text"


def test_a_cut_short_turn_leaves_the_history_as_it_was() -> None:
    store = HistoryStore(HistoryConfig(), max_tokens=1000)
    tokens_turn(store, "s", [1], [2])
    for reason in (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR):
        turn = store.start("s", "r", continues=True)
        turn.begin(HistoryInput.TOKENS, store.continue_tokens(turn, [3], "token_ids"))
        finish(turn, [4], reason=reason)
        assert list(store.get("s").token_ids) == [1, 2]


def test_one_continuing_call_at_a_time_and_plain_calls_are_never_refused() -> None:
    store = HistoryStore(HistoryConfig(), max_tokens=1000)
    tokens_turn(store, "s", [1], [2])
    first = store.start("s", "first", continues=True)
    with pytest.raises(HistoryBusy) as err:
        store.start("s", "second", continues=True)
    assert err.value.request_id == "first"
    store.start("s", "plain", continues=False).release()
    first.release()
    store.start("s", "second", continues=True).release()


def test_missing_history_says_why_it_ended() -> None:
    clock = Clock()
    store = HistoryStore(HistoryConfig(ttl_s=10, max_sessions=2), max_tokens=8, clock=clock)
    with pytest.raises(NoHistory) as err:
        store.start("never", "r", continues=True)
    assert err.value.reason is None
    tokens_turn(store, "a", [1], [2])
    assert store.delete("a") and not store.delete("a")
    with pytest.raises(NoHistory, match="deleted"):
        store.start("a", "r", continues=True)
    tokens_turn(store, "b", [1], [2])
    clock.now = 11
    with pytest.raises(NoHistory, match="--session-ttl"):
        store.start("b", "r", continues=True)
    for key in "cde":
        tokens_turn(store, key, [1], [2])
    with pytest.raises(NoHistory, match="--max-sessions"):
        store.start("c", "r", continues=True)
    tokens_turn(store, "f", [1] * 6, [2, 3])  # 8 tokens: reaches the cap
    with pytest.raises(NoHistory, match="--max-session-tokens"):
        store.start("f", "r", continues=True)
    # A new history under an ended key starts afresh.
    tokens_turn(store, "f", [1], [2])
    assert store.get("f") is not None


def test_continued_prompt_over_the_token_cap_is_refused_naming_the_flag() -> None:
    store = HistoryStore(HistoryConfig(max_tokens=5))
    store.check_length(5)
    with pytest.raises(InvalidRequest, match="--max-session-tokens") as err:
        store.check_length(6)
    assert err.value.field == "continue_session"


def test_memory_cap_evicts_least_recently_used_first() -> None:
    store = HistoryStore(HistoryConfig(max_bytes=1), max_tokens=10_000)
    tokens_turn(store, "alone", [1] * 100, [2])
    assert store.get("alone") is None, "a history over the cap on its own is not kept"
    store = HistoryStore(HistoryConfig(max_bytes=3 * 1024), max_tokens=10_000)
    for key in "abcd":
        tokens_turn(store, key, [1] * 100, [2])  # ~660 bytes each
    store.start("a", "r", continues=True).release()  # a is now the most recently used
    tokens_turn(store, "e", [1] * 100, [2])
    assert store.get("b") is None and store.get("a") is not None and store.get("e") is not None
    assert store.nbytes <= 3 * 1024
    with pytest.raises(NoHistory, match="--session-history-mib"):
        store.start("b", "r", continues=True)


def test_delete_during_a_call_writes_no_history() -> None:
    store = HistoryStore(HistoryConfig(), max_tokens=1000)
    tokens_turn(store, "s", [1], [2])
    turn = store.start("s", "r", continues=True)
    turn.begin(HistoryInput.TOKENS, store.continue_tokens(turn, [3], "token_ids"))
    assert store.delete("s")
    finish(turn, [4])
    assert store.get("s") is None


class HistoryMachine(RuleBasedStateMachine):
    """Random calls, deletions and clock steps; the byte count and the limits hold after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.config = HistoryConfig(ttl_s=50, max_sessions=3, max_bytes=2048)
        self.store = HistoryStore(self.config, max_tokens=64, clock=self.clock)
        self.open: list[Turn] = []
        self.model: dict[str, list[int]] = {}  # key -> what a continuing call would read, when held

    @rule(key=st.sampled_from("abcde"), prompt=st.lists(st.integers(0, 99), min_size=1, max_size=40))
    def start_plain(self, key: str, prompt: list[int]) -> None:
        turn = self.store.start(key, "r", continues=False)
        turn.begin(HistoryInput.TOKENS, prompt)
        self.open.append(turn)

    @rule(key=st.sampled_from("abcde"), new=st.lists(st.integers(0, 99), min_size=1, max_size=8))
    def start_continuing(self, key: str, new: list[int]) -> None:
        try:
            turn = self.store.start(key, "r", continues=True)
        except (NoHistory, HistoryBusy):
            return
        turn.begin(HistoryInput.TOKENS, self.store.continue_tokens(turn, new, "token_ids"))
        assert turn.prompt_ids[: -len(new)] == list(turn.held.token_ids)
        self.open.append(turn)

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 10), answer=st.lists(st.integers(0, 99), min_size=1, max_size=8), ok=st.booleans())
    def finish_one(self, i: int, answer: list[int], ok: bool) -> None:
        turn = self.open.pop(i % len(self.open))
        finish(turn, answer, reason=FinishReason.EOS if ok else FinishReason.CANCELLED)
        held = self.store.get(turn.key)
        if ok and not turn.dropped and held is not None:
            assert list(held.token_ids) == turn.prompt_ids + answer

    @rule(key=st.sampled_from("abcde"))
    def delete(self, key: str) -> None:
        self.store.delete(key)
        assert self.store.get(key) is None

    @rule(dt=st.floats(0, 30))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @invariant()
    def within_limits(self) -> None:
        self.store.expire()
        held = [self.store.get(k) for k in "abcde"]
        held = [h for h in held if h is not None]
        assert self.store.nbytes == sum(h.nbytes for h in held)
        assert len(held) == len(self.store) <= self.config.max_sessions
        assert self.store.nbytes <= self.config.max_bytes
        assert all(len(h.token_ids) < 64 and self.clock.now - h.last_used < self.config.ttl_s for h in held)


TestHistoryMachine = HistoryMachine.TestCase
TestHistoryMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
