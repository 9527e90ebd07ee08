"""The core's adapter books (lora/serving.py) over adapters made with PEFT: --lora at start, load/unload/list, pins
that keep a request's adapter in memory, re-reading an adapter unloaded to make room, the slots of a step's plan."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmserve.engine.config import EngineConfig
from llmserve.engine.lora.serving import LoraServing
from llmserve.engine.lora.slot_books import TooManyAdapters
from llmserve.engine.sched.plan import NO_ADAPTER, SeqStep, StepPlan
from llmserve.engine.types.adapters import (
    AdapterExists,
    AdapterNotFound,
    AdapterRefused,
    AdaptersBusy,
    ListAdapters,
    LoadAdapter,
    UnknownAdapter,
    UnloadAdapter,
)
from llmserve.engine.types.model import LoadedModel
from tests.engine.lora.adapter_checks import check_registry
from tests.engine.lora.peft_adapters import make_adapter


@pytest.fixture(scope="module")
def folders(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serving")
    made = {f"r{r}": make_adapter(tiny.model, root / f"r{r}", seed=r, merge=False, r=r).folder for r in (2, 4, 8)}
    made["r32"] = make_adapter(tiny.model, root / "r32", seed=5, merge=False, r=32).folder
    return made


def serving(tiny: LoadedModel, folders: dict[str, Path], **config: object) -> LoraServing:
    base = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    return LoraServing(EngineConfig(**{**base, **config}), tiny.shape)  # type: ignore[arg-type]


def test_start_loads_and_the_answers(tiny: LoadedModel, folders: dict[str, Path]) -> None:
    books = serving(tiny, folders, loras=(("a", str(folders["r2"])), ("b", str(folders["r4"]))))
    answer = books.apply(ListAdapters())
    assert answer.names == {"a", "b"} and (answer.limits.max_loras, answer.limits.max_cpu_loras) == (2, 2)
    a = next(i for i in answer.adapters if i.name == "a")
    assert (a.rank, a.resident, a.running_requests, a.path) == (2, True, 0, str(folders["r2"]))
    assert len(a.target_modules) == 7 and a.host_bytes > 0  # every target projection (peft_adapters.py)
    with pytest.raises(AdapterExists):
        books.apply(LoadAdapter("a", str(folders["r8"])))
    with pytest.raises(UnknownAdapter):
        books.apply(UnloadAdapter("nope"))
    # A refused adapter names its file; nothing changes.
    with pytest.raises(AdapterRefused, match="rank 32 is above --max-lora-rank 8"):
        books.prepare(LoadAdapter("c", str(folders["r32"])))
    with pytest.raises(AdapterNotFound, match="no such adapter folder"):
        books.prepare(LoadAdapter("c", "/nonexistent/adapter"))
    assert books.apply(ListAdapters()).names == {"a", "b"}


def test_a_refused_adapter_at_start_stops_the_start(tiny: LoadedModel, folders: dict[str, Path]) -> None:
    with pytest.raises(AdapterRefused, match="adapter_model.safetensors"):
        broken = folders["r2"].parent / "broken"
        shutil.copytree(folders["r2"], broken, dirs_exist_ok=True)
        (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        serving(tiny, folders, loras=(("a", str(broken)),))


def test_held_adapters_stay_idle_ones_go_and_come_back(tiny: LoadedModel, folders: dict[str, Path]) -> None:
    books = serving(tiny, folders, loras=(("a", str(folders["r2"])), ("b", str(folders["r4"]))))
    held_a, held_b = books.acquire("a"), books.acquire("b")
    assert books.requests["a"] == 1
    # Both in memory are held: a third cannot come in (RESOURCE_EXHAUSTED for the caller), nothing changes.
    c = books.prepare(LoadAdapter("c", str(folders["r8"])))
    with pytest.raises(AdaptersBusy):
        books.apply(LoadAdapter("c", str(folders["r8"])), c)
    books.release(held_a)
    loaded = books.apply(LoadAdapter("c", str(folders["r8"])), c).loaded  # a, idle, leaves memory; its name stays
    assert loaded is not None and loaded.rank == 8
    states = {i.name: i.resident for i in books.infos()}
    assert states == {"a": False, "b": True, "c": True}
    books.release(held_b)
    reads = books.reads
    again = books.acquire("a")  # read again from its folder; c (idle since its load, before b) makes room
    assert again.payload.rank == 2 and books.reads == reads + 1
    assert {i.name: i.resident for i in books.infos()} == {"a": True, "b": True, "c": False}
    # Unloading a held adapter drains: its name goes at once, its memory when the last holder lets go.
    assert books.unload("a") == 1 and "a" not in books.names()
    with pytest.raises(UnknownAdapter):
        books.acquire("a")
    books.release(again)
    check_registry(books.registry)


def test_a_steps_slots_and_writes(tiny: LoadedModel, folders: dict[str, Path]) -> None:
    books = serving(tiny, folders, max_cpu_loras=3, loras=tuple((n, str(folders[n])) for n in ("r2", "r4", "r8")))
    h2, h4, h8 = books.acquire("r2"), books.acquire("r4"), books.acquire("r8")

    def plan(*held: object) -> StepPlan:
        out = StepPlan(seqs=[SeqStep(None, 0, [1], [], None) for _ in held])  # type: ignore[arg-type]
        books.assign(out, held)  # type: ignore[arg-type]
        return out

    first = plan(h2, None, h4, h2)
    slots = [s.lora_slot for s in first.seqs]
    assert slots[1] == NO_ADAPTER and slots[0] == slots[3] != slots[2] != NO_ADAPTER
    assert sorted(first.lora_writes, key=lambda w: w[0]) == [(slots[0], h2.payload), (slots[2], h4.payload)]
    assert plan(h4, h2).lora_writes == []  # already in their slots: nothing to copy
    third = plan(h8, h4)  # r8 takes r2's slot (least recently used), r4 keeps its own
    assert third.lora_writes == [(slots[0], h8.payload)] and third.seqs[1].lora_slot == slots[2]
    assert plan(None, None).lora_writes == [] and books.slots.num_writes == 3
    with pytest.raises(TooManyAdapters):  # the scheduler's bound (--max-loras) keeps a step from this
        plan(h2, h4, h8)
