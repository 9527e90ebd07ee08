"""Draft proposers scored offline on SmolLM2's real greedy answers: acceptance, tokens per step, cost per call.

    python benchmarks/probes/spec_samples.py       # once: the answers (.cache/spec-samples.json)
    flock -x /work/cpu.lock python benchmarks/probes/spec_proposers.py [--json out.json]

Greedy speculative decoding emits exactly the greedy answer, so a proposer's run over an answer is simulated
without the model: at each step the proposer drafts from the prompt and the answer so far, the drafts that match
the answer's next tokens are accepted, and the model's own next token (the correction, or the bonus after a full
acceptance) is emitted with them. Per workload and proposer: steps per answer token (1.0 without speculation),
mean tokens emitted per step, the share of proposed tokens accepted, and the proposer's host time per call (mean
and p99, every call of every answer; a step at 32 sequences costs 32 calls).

The suffix proposer runs each workload's answers one after another under one identity, so that later requests
find earlier answers in its tree, as a server's requests of one caller do. Constrained answers (`json`) also run
with the grammar's forced tokens, alone and followed by a prompt-lookup guess that the grammar checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paths import make_importable  # noqa: E402

make_importable()

from llmserve.process import configure_process  # noqa: E402

configure_process()  # as `python -m llmserve` does, before torch loads

from benchmarks.probes.spec_samples import DEFAULT_OUT  # noqa: E402
from llmserve.engine.spec.ngram import NgramConfig, NgramProposer  # noqa: E402
from llmserve.engine.spec.suffix import SuffixConfig, SuffixProposer  # noqa: E402

# propose(key, tokens so far, k) -> drafts; start/stop bracket one answer.
Propose = Callable[[int, list[int], int], list[int]]


@dataclass(slots=True)
class Score:
    answer_tokens: int = 0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    call_us: list[float] = field(default_factory=list)
    start_us: list[float] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        calls = sorted(self.call_us)
        return {
            "tokens_per_step": self.answer_tokens / max(1, self.steps),
            "acceptance": self.accepted / max(1, self.proposed),
            "proposed_per_step": self.proposed / max(1, self.steps),
            "call_us_mean": statistics.fmean(calls) if calls else 0.0,
            "call_us_p99": calls[int(0.99 * (len(calls) - 1))] if calls else 0.0,
            "start_us_mean": statistics.fmean(self.start_us) if self.start_us else 0.0,
        }


class Method:
    """One proposer under test: start/propose/stop around each answer."""

    def __init__(self, name: str) -> None:
        self.name = name

    def start(self, key: int, prompt: list[int], sample: dict) -> None:  # noqa: B027
        pass

    def propose(self, key: int, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def emitted(self, key: int, tokens: list[int]) -> None:  # noqa: B027
        pass

    def stop(self, key: int, tokens: list[int]) -> None:  # noqa: B027
        pass


class Ngram(Method):
    def __init__(self, config: NgramConfig) -> None:
        super().__init__(f"ngram n={config.min_n}..{config.max_n} {'latest' if config.latest else 'earliest'}")
        self.proposer = NgramProposer(config)

    def propose(self, key: int, tokens: list[int], k: int) -> list[int]:
        return self.proposer.propose(key, tokens, k)

    def stop(self, key: int, tokens: list[int]) -> None:
        self.proposer.release(key)


class Suffix(Method):
    """`own_only`: every request an identity of its own, so that no earlier answer is drafted from."""

    def __init__(self, config: SuffixConfig, own_only: bool = False) -> None:
        own = ", own context only" if own_only else ""
        super().__init__(f"suffix p>={config.min_token_prob} factor {config.max_spec_factor}{own}")
        self.proposer = SuffixProposer(config)
        self.own_only = own_only

    def start(self, key: int, prompt: list[int], sample: dict) -> None:
        self.proposer.start(key, f"request-{key}" if self.own_only else None, prompt)

    def propose(self, key: int, tokens: list[int], k: int) -> list[int]:
        return self.proposer.propose(key, tokens, k)

    def stop(self, key: int, tokens: list[int]) -> None:
        self.proposer.release(key, tokens)


class Grammar(Method):
    """The grammar's forced tokens, optionally followed by another method's guess that the grammar checks."""

    def __init__(self, compiler: object, then: Method | None) -> None:
        super().__init__("forced" + (f" + {then.name}" if then is not None else ""))
        self.compiler = compiler
        self.then = then
        self.matchers: dict[int, object] = {}
        self.fed: dict[int, int] = {}

    def start(self, key: int, prompt: list[int], sample: dict) -> None:
        from llmserve.engine.request import ConstraintKind, ConstraintSpec

        spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, sample["schema"])
        self.matchers[key] = self.compiler.compile_now(spec).start().matcher  # type: ignore[attr-defined]
        self.fed[key] = len(prompt)
        if self.then is not None:
            self.then.start(key, prompt, sample)

    def propose(self, key: int, tokens: list[int], k: int) -> list[int]:
        from llmserve.engine.spec.forced import grammar_drafts

        matcher = self.matchers[key]
        new = tokens[self.fed[key] :]
        if new:
            matcher.consume_tokens(new)  # type: ignore[attr-defined]
            self.fed[key] = len(tokens)
        guess: list[int] = []
        if self.then is not None:
            guess = self.then.propose(key, tokens, k)
        drafts, _ = grammar_drafts(matcher, k, guess)
        return drafts

    def stop(self, key: int, tokens: list[int]) -> None:
        self.matchers.pop(key)
        if self.then is not None:
            self.then.stop(key, tokens)


def simulate(method: Method, samples: list[dict], k: int) -> Score:
    """Greedy speculative decoding of each answer in turn with `method`'s drafts (see the module docstring)."""
    score = Score()
    for key, sample in enumerate(samples):
        prompt, answer = sample["prompt"], sample["answer"]
        tokens = list(prompt)
        begin = time.perf_counter()
        method.start(key, prompt, sample)
        score.start_us.append((time.perf_counter() - begin) * 1e6)
        i = 0
        while i < len(answer):
            begin = time.perf_counter()
            drafts = method.propose(key, tokens, k)[: max(0, min(k, len(answer) - i - 1))]
            score.call_us.append((time.perf_counter() - begin) * 1e6)
            m = 0
            while m < len(drafts) and drafts[m] == answer[i + m]:
                m += 1
            score.proposed += len(drafts)
            score.accepted += m
            score.steps += 1
            tokens.extend(answer[i : i + m + 1])
            i += m + 1
        score.answer_tokens += len(answer)
        method.stop(key, tokens)
    return score


def methods_for(workload: str, compiler: object | None) -> list[Callable[[], Method]]:
    out: list[Callable[[], Method]] = [
        lambda: Ngram(NgramConfig(2, 4, 16, latest=True)),
        lambda: Ngram(NgramConfig(2, 4, 16, latest=False)),
        lambda: Ngram(NgramConfig(1, 3, 16, latest=True)),
        lambda: Ngram(NgramConfig(3, 5, 16, latest=True)),
        lambda: Suffix(SuffixConfig(k=16)),
        lambda: Suffix(SuffixConfig(k=16, min_token_prob=0.3)),
        lambda: Suffix(SuffixConfig(k=16, max_spec_factor=2.0)),
        lambda: Suffix(SuffixConfig(k=16), own_only=True),
    ]
    if workload == "json" and compiler is not None:
        out += [
            lambda: Grammar(compiler, None),
            lambda: Grammar(compiler, Ngram(NgramConfig(2, 4, 16))),
            lambda: Grammar(compiler, Suffix(SuffixConfig(k=16))),
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", type=Path, default=None, help="write the table here too")
    args = parser.parse_args()
    data = json.loads(args.samples.read_text())
    from llmserve.engine.constraints import ConstraintCompiler
    from llmserve.models import load_model

    loaded = load_model(None, device="cpu", dtype="float32")
    compiler = ConstraintCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    results = []
    for workload in ("edit", "json", "chat"):
        samples = [s for s in data["samples"] if s["workload"] == workload]
        for make in methods_for(workload, compiler):
            for k in args.ks:
                method = make()
                row = {"workload": workload, "method": method.name, "k": k, **simulate(method, samples, k).row()}
                results.append(row)
                print(
                    f"{workload:5} {row['method']:34} k={k:2}  tokens/step {row['tokens_per_step']:5.2f}  "
                    f"accepted {row['acceptance']:5.1%}  drafts/step {row['proposed_per_step']:5.2f}  "
                    f"call {row['call_us_mean']:6.1f} us (p99 {row['call_us_p99']:6.1f}), "
                    f"start {row['start_us_mean']:6.0f} us",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
