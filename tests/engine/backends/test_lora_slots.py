"""Every forward with LoRA slots, driven by the real scheduler (chunked prefill, preemption) and the core's adapter
books (lora/serving.py): three adapters of different ranks and base requests in one batch, each request's greedy
output equal to `generate` on PEFT's merge_and_unload of its adapter run alone (float32), base requests equal to
the base model alone. The CPU's fused forward, the CPU through transformers' layers (hooks), the torch backend and
the CUDA backend (its step buffers and padded decode path, the varlen kernel in Triton's interpreter) run eagerly
on the CPU. A planted mix-up (rows given another row's slot) fails."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.engine.backends import create_backend
from llmserve.engine.backends.cpu.packed_linear import bf16_available
from llmserve.engine.config import EngineConfig
from llmserve.engine.lora.serving import LoraServing, ResidentAdapter
from llmserve.engine.sample.sampler import Sampled
from llmserve.engine.sched.block_pool import BlockPool
from llmserve.engine.sched.plan import NO_ADAPTER, StepPlan
from llmserve.engine.sched.scheduler import Scheduler
from llmserve.engine.sched.sequence import Sequence
from llmserve.engine.sched.sessions import SessionStore
from llmserve.engine.types.adapters import LoraUnsupported
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.outputs import FinishReason
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import load_model
from tests.engine.lora.peft_adapters import make_adapter
from tests.testing import greedy_reference, tiny_model

ADAPTERS: dict[str, dict[str, Any]] = {
    "all-r2": dict(r=2, lora_alpha=4),
    "qvd-r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "kogu-r8": dict(r=8, lora_alpha=16, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
}
# (adapter, prompt length, new tokens): chunks of 40 tokens (segments of 32+ rows), decodes (grouped rows).
JOBS: list[tuple[str | None, int, int]] = [
    ("all-r2", 70, 10),
    (None, 45, 9),
    ("qvd-r4", 90, 12),
    ("kogu-r8", 33, 10),
    ("all-r2", 12, 11),
    (None, 100, 30),  # decodes alone at the end: base-only steps (the CUDA graphs replay them)
    ("kogu-r8", 64, 9),
    ("qvd-r4", 5, 12),
]
CONFIG = EngineConfig(
    block_size=16, kv_cache_tokens=16 * 22, max_num_seqs=8, max_num_batched_tokens=40, enable_prefix_caching=False,
    enable_lora=True, max_loras=3, max_lora_rank=8,
)  # fmt: skip


@dataclass(slots=True)
class Made:
    loaded: LoadedModel
    folders: dict[str, Path]
    prompts: list[list[int]]
    expected: list[list[int]]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    loaded = tiny_model("llama")
    reference = copy.deepcopy(loaded.model)  # the backends swap the model's attention for their own
    reference.set_attn_implementation("sdpa")
    root = tmp_path_factory.mktemp("adapters")
    merged: dict[str | None, Any] = {None: reference}
    folders = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        adapter = make_adapter(reference, root / name, seed=20 + seed, **lora)
        merged[name], folders[name] = adapter.merged, adapter.folder
    gen = torch.Generator().manual_seed(5)
    vocab = loaded.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for _, n, _ in JOBS]
    expected = [greedy_reference(merged[name], p, new) for (name, _, new), p in zip(JOBS, prompts, strict=True)]
    return Made(loaded, folders, prompts, expected)


def run_jobs(backend: Any, serving: LoraServing, made: Made, planted: bool = False) -> tuple[list[list[int]], int]:
    """The jobs through the scheduler and `backend`, as the core runs them; (outputs, preemptions)."""
    pool = BlockPool(backend.num_blocks, CONFIG.block_size)
    sessions = SessionStore(pool, ttl_s=60, max_sessions=4, max_pool_fraction=0.5)
    scheduler = Scheduler(
        pool, sessions, max_num_seqs=CONFIG.max_num_seqs, max_num_batched_tokens=CONFIG.max_num_batched_tokens,
        enable_prefix_caching=False,
    )  # fmt: skip
    held: dict[int, ResidentAdapter | None] = {}
    seqs = []
    for i, ((name, _, new), prompt) in enumerate(zip(JOBS, made.prompts, strict=True)):
        request = GenerationRequest(
            f"r{i}", tuple(prompt), stopping=StoppingParams(max_new_tokens=new, ignore_eos=True)
        )
        seq = Sequence(request, list(prompt), 0.0, i)
        held[i] = None if name is None else serving.acquire(name)
        seqs.append(seq)
        scheduler.add(seq)
    while scheduler.has_work:
        plan: StepPlan = scheduler.schedule()
        serving.assign(plan, [held[s.seq.seq_no] for s in plan.seqs])
        if planted:  # the mix-up a bug in the row mapping would make: two adapter rows trade slots
            slotted = [s for s in plan.seqs if s.lora_slot != NO_ADAPTER]
            if len({s.lora_slot for s in slotted}) > 1:
                slotted[0].lora_slot, slotted[-1].lora_slot = slotted[-1].lora_slot, slotted[0].lora_slot
        results = backend.execute(plan)
        scheduler.update(plan)
        for entry, result in zip(plan.sampling, results, strict=True):
            assert isinstance(result, Sampled)
            seq = entry.seq
            seq.token_ids.append(result.token_id)
            if seq.num_generated == seq.request.stopping.max_new_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
                if held[seq.seq_no] is not None:
                    serving.release(held[seq.seq_no])  # type: ignore[arg-type]
    assert len(serving.registry._held) == 0
    return [s.token_ids[s.num_prompt :] for s in seqs], scheduler.num_preemptions


def serving_for(made: Made) -> LoraServing:
    config = EngineConfig(**{**_fields(CONFIG), "loras": tuple((n, str(f)) for n, f in made.folders.items())})
    return LoraServing(config, made.loaded.shape)


def _fields(config: EngineConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


BACKENDS = {
    "cpu-fused": dict(kind="cpu"),
    "cpu-hooks": dict(kind="cpu", fused_layers=False),
    "torch": dict(kind="torch"),
    # The varlen kernel through Triton's interpreter: the step buffers pack the rows in input-batch row order.
    "cuda-eager": dict(kind="cuda", capture=False, attention_kernel="triton"),
}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_mixed_adapters_under_chunking_and_preemption_equal_merged_generate(made: Made, name: str) -> None:
    options = dict(BACKENDS[name])
    kind, capture = options.pop("kind"), options.pop("capture", True)
    config = EngineConfig(**{**_fields(CONFIG), **options})
    backend = create_backend(made.loaded, config, 512, kind=kind, capture=capture)  # type: ignore[arg-type]
    assert backend.lora is not None  # type: ignore[attr-defined]
    if name == "cpu-fused":
        assert backend.fused is not None and backend.lora.hooks is None  # type: ignore[attr-defined]
    serving = serving_for(made)
    outputs, preemptions = run_jobs(backend, serving, made)
    assert preemptions > 0, "the pool was meant to be small enough to preempt"
    assert serving.slots.num_writes >= len(ADAPTERS)
    for job, got, want in zip(JOBS, outputs, made.expected, strict=True):
        assert got == want, f"{name}: {job}"
    if name == "cuda-eager":
        assert backend.graphs.replays > 0, "no base-only decode step went through the padded path"  # type: ignore[attr-defined]


def test_rows_given_another_rows_slot_are_caught(made: Made) -> None:
    backend = create_backend(made.loaded, CONFIG, 512, kind="cpu")
    outputs, _ = run_jobs(backend, serving_for(made), made, planted=True)
    assert outputs != made.expected


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_lora_beside_bfloat16_or_int8_on_the_fused_forward_is_refused(dtype: str) -> None:
    """The fused CPU forward adds adapter deltas in float32 only: LoRA beside --dtype bfloat16 or int8 stops the
    start with a message naming both (python -m llmserve exits 2: tests/service/test_adapter_servicer.py)."""
    try:
        loaded = load_model("random:tiny", device="cpu", dtype=dtype)
    except ValueError as exc:  # int8 below AVX512-VNNI
        pytest.skip(str(exc))
    if not bf16_available():
        pytest.skip("below AVX512-BF16 a bfloat16 model runs transformers' layers, whose hooks serve LoRA")
    with pytest.raises(LoraUnsupported, match=f"--dtype {dtype} with LoRA adapters"):
        create_backend(loaded, EngineConfig(kv_cache_tokens=256, enable_lora=True), 512, kind="cpu")
    backend = create_backend(loaded, EngineConfig(kv_cache_tokens=256), 512, kind="cpu")  # without LoRA: served
    assert backend.fused is not None  # type: ignore[attr-defined]


def test_no_lora_config_allocates_nothing(made: Made) -> None:
    backend = create_backend(made.loaded, EngineConfig(kv_cache_tokens=256), 512, kind="cpu")
    assert backend.lora is None  # type: ignore[attr-defined]
