"""The sampler's constraint masks: which tokens each constrained row of a step may pick, as an additive mask.

`constraint_masks` fills the bitmask of every constrained row of a step in one batched call to llguidance (its
threads, without the GIL) and turns it into float rows to add to the logits (0 where allowed, -inf elsewhere);
rows without a constraint are not touched. What it needs is built on the first constrained step, once per process
(`TokenMasks.shared()`): the library's executor, and the byte-to-mask table per device. The library's own torch
helpers (llguidance.torch) are not imported: they compile a kernel with torch.compile at import, which loads
torch's compiler stack (seconds) into every process that imports the sampler.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import llguidance
import torch

from llmserve.engine.sched.sequence import GrammarState


class TokenMasks:
    """The executor that fills bitmasks and the per-device table that expands them; thread-safe."""

    _shared: TokenMasks | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        # Its threads are the library's, which drops the GIL while it fills the rows.
        self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
        self._tables: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def shared(cls) -> TokenMasks:
        """This process's masks, built on first use."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def bitmask(self, states: Sequence[GrammarState], vocab_size: int) -> torch.Tensor:
        """The allowed tokens of each state as an int32 CPU bitmask [len(states), ceil(vocab / 32)]."""
        words = (vocab_size + 31) // 32
        bitmask = torch.full((len(states), words), -1, dtype=torch.int32)
        matchers = [(state.matcher, i) for i, state in enumerate(states)]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(states))
        return bitmask

    def additive(self, bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[rows, vocab_size] float32 on `device`: 0.0 where the bitmask allows the token, -inf elsewhere.

        Each byte of the bitmask picks its 8 tokens' row of a 256-row table: adding a float mask gathered per byte
        beats masked_fill with an unpacked bool mask, 0.6 vs 3.4 ms at [32, 49152] on the 2-core machine
        (benchmarks/probes/constraint_libraries.py)."""
        table = self._tables.get(device)
        if table is None:
            bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
            table = self._tables[device] = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
        data = bitmask.to(device, non_blocking=True).view(torch.uint8).view(-1).long()
        return table.index_select(0, data).view(bitmask.shape[0], -1)[:, :vocab_size]


def constraint_masks(states: Sequence[GrammarState], vocab_size: int, device: torch.device) -> torch.Tensor:
    """The additive masks of a step's constrained rows, in order."""
    masks = TokenMasks.shared()
    return masks.additive(masks.bitmask(states, vocab_size), vocab_size, device)
