"""What bfloat16 and int8 cost in accuracy on the CPU, against float32, on the served model (issue 35).

- Greedy agreement: for each of a fixed set of chat prompts, 64 greedy tokens from the engine in float32,
  bfloat16 and int8 (each prompt alone); per prompt, the share of tokens identical to float32's before the first
  difference. The same for transformers' own bfloat16 `generate` against the engine's bfloat16 (reported, not
  asserted: two bfloat16 implementations round differently).
- Perplexity of tests/data/perplexity.txt (public-domain prose, ~650 tokens) under each dtype, every token's
  logits from one forward of the backend (the path the engine serves).
- Variants that put some linears in another kind (`--variants "bfloat16:head=float32" "int8:head=bfloat16"`,
  the names `head`, `qkv`, `o`, `gate_up`, `down`): the measurements behind the precisions' choices.

    python benchmarks/probes/dtype_accuracy.py --out benchmarks/results/DATE-cpu-dtype-accuracy

Writes OUT.json and OUT.md. CPU only; loads the default model from the local cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

from llmserve.process_settings import configure_process  # noqa: E402

TEXT = ROOT / "tests" / "data" / "perplexity.txt"
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one paragraph.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a pet turtle.",
    "How many continents are there? Name them.",
    "Write a limerick about a cat.",
    "What is 17 times 23?",
    "Describe the water cycle.",
)
NEW_TOKENS = 64


def prefix_agreement(a: list[int], b: list[int]) -> float:
    """The share of `a`'s tokens equal to `b`'s before the first difference."""
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same / max(len(a), 1)


def load(dtype: str, swaps: dict[str, str]) -> Any:
    """An engine core over the default model as the server loads it; `swaps` {linear name: kind} rebuilds those
    linears of the fused forward in another packed_linear kind (the LM head: "head")."""
    import torch

    from llmserve.engine.backends.cpu import native
    from llmserve.engine.backends.cpu.packed_linear import RefinedHead, make_linear
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.core.engine_core import EngineCore
    from llmserve.models.loader import load_model

    loaded = load_model(None, device="cpu", dtype=dtype)
    core = EngineCore(loaded, EngineConfig(kv_cache_tokens=4096, max_num_seqs=4, max_num_batched_tokens=1024))
    fused, mixed = core.backend.fused, native.load_mixed()
    base = loaded.model.model

    def rebuild(weights: list[torch.Tensor], kind: str, gives: torch.dtype) -> Any:
        return make_linear(torch.cat([w.detach().float() for w in weights]), None, kind, True, mixed, gives)

    for name, kind in swaps.items():
        if name == "head":  # float32: a plain packed head; else refined as the fused forward builds it
            weight = loaded.model.get_output_embeddings().weight
            fused.lm_head = rebuild([weight], kind, torch.float32)
            if kind != "float32":
                fused.lm_head = RefinedHead(fused.lm_head, weight.detach(), mixed)
            continue
        for layer, module in zip(fused.layers, base.layers, strict=True):
            attn, mlp = module.self_attn, module.mlp
            parts = {
                "qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
                "o": [attn.o_proj],
                "gate_up": [mlp.gate_proj, mlp.up_proj],
                "down": [mlp.down_proj],
            }[name]
            gives = loaded.dtype if name == "qkv" else torch.float32
            setattr(layer, name, rebuild([m.weight for m in parts], kind, gives))
    return core


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """ "int8:head=bfloat16,down=bfloat16" -> ("int8", {"head": "bfloat16", "down": "bfloat16"})."""
    dtype, _, rest = text.partition(":")
    return dtype, dict(item.split("=", 1) for item in rest.split(",") if item)


def greedy(core: Any, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    from llmserve.engine.types.request import GenerationRequest, StoppingParams

    handle_tokens: list[int] = []
    core.submit(GenerationRequest("g", tuple(prompt), stopping=StoppingParams(new_tokens, ignore_eos=True)))
    core.drain_inbox()
    while len(handle_tokens) < new_tokens:
        core.step()
        for output in core.take_outputs():
            handle_tokens.extend(output.token_ids)
    return handle_tokens


def perplexity(core: Any, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of `ids[1:]`, from one forward of the backend over the whole text, its
    attention as the backend attends (every token through the decode kernel in bfloat16 and int8)."""
    import torch

    from llmserve.engine.backends.attention import Chunk, GatheredAttention
    from tests.testing import one_prompt_attention

    backend = core.backend
    tokens = len(ids)
    if backend.fused is not None and not backend.fused.precision.exact:
        batch: Any = one_prompt_attention(backend, tokens)
    else:
        batch = GatheredAttention(backend.kv.tensor, torch.arange(tokens), [], [Chunk(0, tokens, None, None)])
    with torch.inference_mode():
        logits = backend.forward.logits(torch.tensor([ids]), torch.arange(tokens)[None], None, batch)
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def transformers_bf16(prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy generate on the bfloat16 model, each prompt alone."""
    from llmserve.models.loader import load_model
    from tests.testing import greedy_reference

    loaded = load_model(None, device="cpu", dtype="bfloat16")
    loaded.model.set_attn_implementation("sdpa")
    return [greedy_reference(loaded.model, p, NEW_TOKENS) for p in prompts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md are written")
    parser.add_argument("--variants", nargs="*", default=["bfloat16:head=float32"], help="DTYPE:LINEAR=KIND,...")
    args = parser.parse_args()
    configure_process()
    import torch

    torch.manual_seed(0)
    from llmserve.models.loader import load_model

    tokenizer = load_model(None, device="cpu", dtype="float32").tokenizer
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    text_ids = tokenizer(TEXT.read_text())["input_ids"]
    runs: dict[str, Any] = {}
    for text in ["float32", "bfloat16", "int8", *args.variants]:
        dtype, swaps = parse_variant(text)
        name = dtype + "".join(f", {k} {v}" for k, v in swaps.items())
        core = load(dtype, swaps)
        runs[name] = {
            "backend": core.backend.description,
            "tokens": [greedy(core, p) for p in prompts],
            "perplexity": perplexity(core, text_ids),
        }
        print(name, "perplexity", round(runs[name]["perplexity"], 3), flush=True)
        del core
    reference = runs["float32"]["tokens"]
    for run in runs.values():
        run["agreement"] = [prefix_agreement(t, r) for t, r in zip(run["tokens"], reference, strict=True)]
    hf = transformers_bf16(prompts)
    hf_agreement = [prefix_agreement(t, h) for t, h in zip(runs["bfloat16"]["tokens"], hf, strict=True)]
    result = {
        "questions": QUESTIONS,
        "text_tokens": len(text_ids),
        "runs": runs,
        "transformers_bf16_agreement": hf_agreement,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(report(result))
    print(report(result))
    return 0


def report(result: dict[str, Any]) -> str:
    runs = result["runs"]
    base = runs["float32"]["perplexity"]
    lines = [
        "# bfloat16 and int8 on the CPU: accuracy against float32 (SmolLM2-135M-Instruct)",
        "",
        f"Perplexity of tests/data/perplexity.txt ({result['text_tokens']} tokens) and greedy agreement with float32",
        f"over {len(result['questions'])} chat prompts ({NEW_TOKENS} tokens each: the share identical before the first",
        "difference), `python benchmarks/probes/dtype_accuracy.py`.",
        "",
        "| dtype | perplexity | change | agreement with float32: mean | median | prompts identical |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        a = sorted(run["agreement"])
        lines.append(
            f"| {name} | {run['perplexity']:.3f} | {100 * (run['perplexity'] / base - 1):+.2f}% | "
            f"{sum(a) / len(a):.2f} | {a[len(a) // 2]:.2f} | {sum(x == 1.0 for x in a)}/{len(a)} |"
        )
    lines += [
        "",
        "Per prompt (agreement with float32; last column: the engine's bfloat16 against transformers' own bf16",
        "`generate`):",
        "",
        "| prompt | " + " | ".join(runs) + " | bf16 vs transformers bf16 |",
        "|---|" + "---|" * (len(runs) + 1),
    ]
    for i, q in enumerate(result["questions"]):
        cells = [f"{run['agreement'][i]:.2f}" for run in runs.values()]
        lines.append(f"| {q} | " + " | ".join(cells) + f" | {result['transformers_bf16_agreement'][i]:.2f} |")
    lines += ["", "Backends:", ""] + [f"- {name}: `{run['backend']}`" for name, run in runs.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
