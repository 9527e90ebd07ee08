"""Exactness at the model level, before the LoRA ops meet the engine: adapters made with PEFT (three ranks, different
targets and scalings) applied by the ops through hooks on the base model's own projections, rows of different
adapters and base rows in one batch, against PEFT's merge_and_unload of each adapter run alone. float32: logits
within a tight tolerance, greedy tokens equal over plain (non-paged, KV-cached) decoding. Base rows beside adapter
rows are bit for bit what they are with no adapter in the batch; a planted mix-up of rows' adapters fails."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.engine.lora.adapters import read_adapter
from llmserve.engine.lora.hooks import LoraHooks
from llmserve.engine.lora.ops import NO_ADAPTER, LoraRows
from llmserve.engine.lora.slot_books import SlotBooks
from llmserve.engine.lora.weights import MODULE_GROUPS, LoraWeights
from llmserve.engine.types.model import LoadedModel
from tests.engine.lora.peft_adapters import make_adapter
from tests.testing import greedy_reference

# Three adapters of different ranks, targets and scaling rules.
ADAPTERS: dict[str, dict[str, Any]] = {
    "all-r2": dict(r=2, lora_alpha=4),
    "attn-mlp-r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "r8": dict(
        r=8,
        lora_alpha=16,
        target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
        alpha_pattern={"layers.0.mlp.up_proj": 4},
    ),
}
BASE = None


@dataclass(slots=True)
class Served:
    """The base model with hooks over stacked weights holding every adapter, and each adapter's merged reference."""

    model: Any
    hooks: LoraHooks
    slot_of: dict[str, int]
    merged: dict[str, Any]
    num_slots: int

    def rows(self, per_sequence: list[str | None], tokens: int) -> LoraRows | None:
        slots = [NO_ADAPTER if name is None else self.slot_of[name] for name in per_sequence for _ in range(tokens)]
        return LoraRows.of(slots, self.num_slots)

    def reference(self, name: str | None) -> Any:
        return self.model if name is None else self.merged[name]


@pytest.fixture(scope="module")
def served(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(tiny, ADAPTERS, tmp_path_factory.mktemp("adapters"), max_rank=8)


def _serve(loaded: LoadedModel, configs: dict[str, dict[str, Any]], root: Path, max_rank: int) -> Iterator[Served]:
    merged, read = {}, {}
    for seed, (name, config) in enumerate(configs.items()):
        made = make_adapter(loaded.model, root / name, seed=seed + 10, **config)
        merged[name] = made.merged
        read[name] = read_adapter(made.folder, loaded.shape, max_rank)
    books = SlotBooks(len(configs))
    weights = LoraWeights(loaded.shape, len(configs), max_rank, torch.float32, groups=MODULE_GROUPS)
    ids = {name: i for i, name in enumerate(read)}
    assignment = books.assign(ids.values())
    names = {i: name for name, i in ids.items()}
    for slot, adapter_id in assignment.writes:
        weights.write(slot, read[names[adapter_id]])
    hooks = LoraHooks(loaded.model, weights)
    try:
        yield Served(loaded.model, hooks, {n: assignment.slot_of[i] for n, i in ids.items()}, merged, len(configs))
    finally:
        hooks.remove()


def _prompts(n: int, tokens: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n, tokens), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _batch_logits(served: Served, ids: torch.Tensor, names: list[str | None], planted: bool = False) -> torch.Tensor:
    order = list(names)
    if planted:  # the mix-up a bug in the row mapping would make: two rows swap adapters
        order[0], order[-1] = order[-1], order[0]
    served.hooks.rows = served.rows(order, ids.shape[1])
    try:
        logits: torch.Tensor = served.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        return logits
    finally:
        served.hooks.rows = None


@pytest.mark.parametrize("tokens", [5, 40], ids=["grouped", "segments"])
@pytest.mark.parametrize(
    "names",
    [["all-r2", BASE, "attn-mlp-r4", "r8"], ["r8", "all-r2", "r8", BASE, "all-r2"]],
    ids=["one-each", "repeats"],
)
def test_a_mixed_batch_equals_each_merged_adapter_alone(served: Served, tokens: int, names: list[str | None]) -> None:
    ids = _prompts(len(names), tokens, served.model.config.vocab_size)
    logits = _batch_logits(served, ids, names)
    with torch.inference_mode():
        no_lora = served.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        for i, name in enumerate(names):
            alone = served.reference(name)(input_ids=ids[i : i + 1]).logits[0]
            torch.testing.assert_close(logits[i], alone, rtol=1e-5, atol=1e-5)
            if name is BASE:
                assert torch.equal(logits[i], no_lora[i]), "a base row beside adapter rows changed"
            else:
                assert not torch.allclose(logits[i], no_lora[i], atol=1e-3), "the adapter changed nothing"
    planted = _batch_logits(served, ids, names, planted=True)
    assert not torch.allclose(planted[0], logits[0], atol=1e-3), "rows given another row's adapter went unnoticed"


def test_greedy_decoding_equals_each_merged_adapter_alone(served: Served) -> None:
    names = ["attn-mlp-r4", BASE, "r8", "all-r2", "all-r2"]
    prompt_len, steps = 7, 6
    ids = _prompts(len(names), prompt_len, served.model.config.vocab_size, seed=1)
    generated: list[list[int]] = [[] for _ in names]
    with torch.inference_mode():
        served.hooks.rows = served.rows(names, prompt_len)
        out = served.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        past = out.past_key_values
        for _ in range(steps):
            next_ids = out.logits[:, -1].argmax(-1)
            for i, token in enumerate(next_ids.tolist()):
                generated[i].append(token)
            served.hooks.rows = served.rows(names, 1)  # one row per sequence: the decode path
            out = served.model(input_ids=next_ids[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
        served.hooks.rows = None
    for i, name in enumerate(names):
        assert generated[i] == greedy_reference(served.reference(name), ids[i].tolist(), steps), name


@pytest.mark.real_model
def test_smollm2_adapters_of_rank_16_equal_peft_merged(real_model: LoadedModel, tmp_path: Path) -> None:
    # A copy with transformers' own attention: the session's real model may carry a backend's paged attention, and
    # the hooks must not stay on a model other tests share.
    base = copy.deepcopy(real_model.model)
    base.set_attn_implementation("sdpa")
    configs = {"a": dict(r=16, lora_alpha=32), "b": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])}
    for served_model in _serve(dataclasses.replace(real_model, model=base), configs, tmp_path, max_rank=16):
        names: list[str | None] = ["a", BASE, "b"]
        ids = _prompts(len(names), 6, 49152, seed=2)
        logits = _batch_logits(served_model, ids, names)
        with torch.inference_mode():
            for i, name in enumerate(names):
                alone = served_model.reference(name)(input_ids=ids[i : i + 1]).logits[0]
                torch.testing.assert_close(logits[i], alone, rtol=1e-4, atol=1e-4)
                assert logits[i, -1].argmax() == alone[-1].argmax()
