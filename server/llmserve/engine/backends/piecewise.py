"""Mixed steps (prompt chunks beside decodes) without a few hundred eager launches: the candidate behind
`--mixed-steps`, for the CUDA backend's steps that no decode graph covers.

Under load most steps mix prompt chunks with decodes, and the decode graphs (cuda.py) serve none of them: eagerly,
each layer is a dozen small kernels around its GEMMs (norms, rotary, residual adds, SiLU and the gate's product),
launched one by one from Python. Two ways out, as vLLM v1 and SGLang take them:

- `compile`: the model's forward through torch.compile with dynamic shapes. The paged attention function is opaque
  to it (attention.py: the graph breaks there, so the cache write and the varlen kernel run as they do eagerly),
  and the pieces between two layers' attention calls are compiled: inductor fuses each piece's elementwise work
  into a few kernels around the GEMMs. One compile serves every token count (dynamic shapes).
- `compile-graphs`: the same pieces, each replayed from a CUDA graph (inductor's reduce-overhead mode, its
  graph trees): piecewise graphs around attention, as vLLM captures them. A graph has fixed shapes, so a step's
  tokens are padded up to a token bucket (the step buffers' padding: tokens outside every sequence, written to
  the scratch slot) and each bucket is recorded once, on its first step.

`eager` (the default) keeps today's path. Which of the two pays on an H200 is for the GPU to say
(benchmarks/probes/gpu.sh times mixed steps under each); on the CPU the tests check that either is exact.
The compile happens on the first mixed step of each shape class, not at start-up: a first request under
`--mixed-steps compile` waits for it (tens of seconds), which is why it is not the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmserve.engine.backends.attention import AttentionMetadata
from llmserve.engine.backends.step_buffers import StepBuffers
from llmserve.engine.sched.plan import StepPlan

MODES = ("eager", "compile", "compile-graphs")


def token_bucket(n: int, max_tokens: int) -> int:
    """The padded token count of a step of `n` tokens under compile-graphs: the next power of two from 16, at
    most `max_tokens` (a step never has more)."""
    bucket = 16
    while bucket < n:
        bucket *= 2
    return min(bucket, max(max_tokens, n))


class MixedSteps:
    """The forward of the steps the decode graphs do not serve, compiled per `mode` ("compile" or
    "compile-graphs"); `forward` is the backend's model call (its class's, not a patched instance's).

    `compiler` is torch.compile's backend: "inductor" serves; the CPU tests also run "aot_eager" (the same graph
    breaks and traced pieces, without inductor's code generation) to keep the suite fast.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        steps: StepBuffers,
        mode: str,
        *,
        compiler: str = "inductor",
    ) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"--mixed-steps {mode!r}: one of {', '.join(MODES[1:])} (or eager, without this)")
        self.steps = steps
        self.mode = mode
        self.pad = mode == "compile-graphs"
        options: dict[str, Any] = {"dynamic": not self.pad, "backend": compiler}
        if self.pad and compiler == "inductor":  # the graph trees are inductor's (and CUDA's: skipped on the CPU)
            options["mode"] = "reduce-overhead"
        self._forward = torch.compile(forward, **options)
        self.runs = 0  # mixed steps served here

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [len(plan.sampling), vocab], in plan order: the step staged (padded to its token bucket under
        compile-graphs) and the compiled forward run over the step buffers' views."""
        pad = token_bucket(plan.num_tokens, self.steps.max_tokens) if self.pad else None
        step = self.steps.inputs_of(self.steps.write(plan.seqs, tokens_to=pad))
        self.runs += 1
        logits: torch.Tensor = self._forward(step.input_ids, step.positions, step.keep, step.attention)
        return logits
