"""Probe: xgrammar vs llguidance on this machine, with the default model's tokenizer (SmolLM2, 49,152 ids).

Measures, for each library: tokenizer set-up, cold compile of a few JSON schemas, a regex and any-JSON, and the
per-step cost of filling the token bitmask for 32 constrained rows (one batched call, matchers at different
states) plus applying it to [32, 49152] float32 logits. Run:

    PYTHONPATH=server:client python benchmarks/probes/constraint_libraries.py [--threads N]

The figures this chose the library on are in the README of benchmarks/ (Lab notebook: structured output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "status": {"enum": ["active", "inactive", "pending"]},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name"],
            },
            "score": {"type": "number"},
        },
        "required": ["id", "status", "owner"],
    },
    "function_call": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "hourly": {"type": "boolean"},
            "fields": {
                "type": "array",
                "items": {"type": "string", "enum": ["temperature", "wind", "rain", "humidity"]},
            },
        },
        "required": ["location", "unit"],
        "additionalProperties": False,
    },
}
REGEX = r"(\+?1 )?\(?[0-9]{3}\)? ?[0-9]{3}-[0-9]{4}"
# A document that fits SCHEMAS['nested'] (properties in the schema's order), for the matchers to walk through.
DOCUMENT = json.dumps(
    {
        "id": 12,
        "tags": ["a", "bb", "ccc", "dddd"],
        "status": "active",
        "owner": {"name": "Ana Lopez", "email": "ana@example.com"},
        "score": 3.25,
    }
)
ROWS = 32
STEPS = 24


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from llmserve.models import convert_gguf, default_gguf_path

    return AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()), local_files_only=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def probe_xgrammar(tok: Any, vocab: int, eos: list[int], threads: int) -> dict[str, Any]:
    import xgrammar as xgr

    out: dict[str, Any] = {"version": xgr.__version__ if hasattr(xgr, "__version__") else "?"}
    out["tokenizer_ms"], info = timed(
        lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    )
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    for name, schema in SCHEMAS.items():
        out[f"compile_{name}_ms"], _ = timed(lambda s=schema: compiler.compile_json_schema(json.dumps(s)))
    out["compile_regex_ms"], _ = timed(lambda: compiler.compile_regex(REGEX))
    out["compile_json_object_ms"], _ = timed(compiler.compile_builtin_json_grammar)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMAS["nested"]))
    ids = tok.encode(DOCUMENT, add_special_tokens=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    for i, m in enumerate(matchers):  # staggered: row i is i tokens in (mod the document)
        for t in ids[: i % (len(ids) - STEPS - 1)]:
            assert m.accept_token(t), "the document must fit the schema"
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    bitmask = xgr.allocate_token_bitmask(ROWS, vocab)
    fills: list[float] = []
    applies: list[float] = []
    own_applies: list[float] = []
    logits = torch.randn(ROWS, vocab)
    for step in range(STEPS):
        ms, _ = timed(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask))
        fills.append(ms)
        x = logits.clone()
        ms, _ = timed(lambda x=x: _apply_torch(x, bitmask))
        applies.append(ms)
        x = logits.clone()
        ms, _ = timed(lambda x=x: xgr.apply_token_bitmask_inplace(x, bitmask))
        own_applies.append(ms)
        for i, m in enumerate(matchers):
            pos = i % (len(ids) - STEPS - 1) + step
            assert m.accept_token(ids[pos])
    out["fill_32_rows_ms_median"] = statistics.median(fills)
    out["fill_32_rows_ms_max"] = max(fills)
    out["apply_32_rows_ms_median"] = statistics.median(applies)
    out["apply_32_rows_xgrammar_kernel_ms_median"] = statistics.median(own_applies)
    return out


def probe_llguidance(tok: Any, vocab: int, eos: list[int], threads: int) -> dict[str, Any]:
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch as llt

    out: dict[str, Any] = {"version": llg.get_version() if hasattr(llg, "get_version") else "?"}
    out["tokenizer_ms"], lltok = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos))

    def build(grammar: str) -> Any:
        m = llg.LLMatcher(lltok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    for name, schema in SCHEMAS.items():
        out[f"compile_{name}_ms"], _ = timed(
            lambda s=schema: build(llg.LLMatcher.grammar_from_json_schema(json.dumps(s)))
        )
    out["compile_regex_ms"], _ = timed(lambda: build(llg.LLMatcher.grammar_from_regex(REGEX)))
    out["compile_json_object_ms"], _ = timed(lambda: build(llg.LLMatcher.grammar_from_json_schema("{}")))
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMAS["nested"]))
    ids = tok.encode(DOCUMENT, add_special_tokens=False)
    matchers = [build(grammar) for _ in range(ROWS)]
    for i, m in enumerate(matchers):
        assert m.consume_tokens(ids[: i % (len(ids) - STEPS - 1)]), m.get_error()
    executor = llg.LLExecutor(num_threads=threads)
    bitmask = llt.allocate_token_bitmask(ROWS, vocab)
    fills: list[float] = []
    applies: list[float] = []
    logits = torch.randn(ROWS, vocab)
    for step in range(STEPS):
        ms, _ = timed(
            lambda: llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        )
        fills.append(ms)
        x = logits.clone()
        ms, _ = timed(lambda x=x: _apply_torch(x, bitmask))
        applies.append(ms)
        for i, m in enumerate(matchers):
            assert m.consume_token(ids[i % (len(ids) - STEPS - 1) + step]), m.get_error()
    out["fill_32_rows_ms_median"] = statistics.median(fills)
    out["fill_32_rows_ms_max"] = max(fills)
    out["apply_32_rows_ms_median"] = statistics.median(applies)
    return out


# Byte value -> its 8 tokens' additive mask (0 allowed, -inf not): adding beats masked_fill with a bool mask
# (0.3 vs 3.4 ms at [32, 49152] on this machine).
_BYTE_MASK = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def _apply_torch(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    add = _BYTE_MASK.index_select(0, bitmask.view(torch.uint8).view(-1).long()).view(bitmask.shape[0], -1)
    x.add_(add[:, : x.shape[1]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tok = tokenizer()
    vocab = 49152
    eos = [tok.eos_token_id]
    for name, probe in (("xgrammar", probe_xgrammar), ("llguidance", probe_llguidance)):
        print(
            name,
            json.dumps(
                {k: round(v, 3) if isinstance(v, float) else v for k, v in probe(tok, vocab, eos, args.threads).items()}
            ),
        )


if __name__ == "__main__":
    main()
