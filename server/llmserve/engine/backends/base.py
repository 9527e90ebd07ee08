"""What every backend is: the `Backend` protocol, and the KV cache they all keep in one layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmserve.engine.plan import StepPlan
from llmserve.engine.sampler import RowFailed, Sampled


class Backend(Protocol):
    """Runs steps for the engine: owns the model, the KV cache and whatever is compiled or captured for them.

    `execute` does the plan's block copies, one forward over every scheduled token, and samples the rows that
    ask for it. It returns one result per `plan.sampling` entry, in that order: the picked token, or the
    failure of that row's sampling alone. It raises when the shared forward fails (every request of the step
    fails then). Built once, by `create_backend`, before the engine serves anything.
    """

    name: str  # which path serves: "cpu", "torch", "cuda"
    description: str  # one line for the start-up log and GetModelInfo
    device: torch.device
    dtype: torch.dtype
    num_blocks: int  # KV blocks the block pool may hand out (the cache has one scratch block more)
    block_size: int

    def execute(self, plan: StepPlan) -> list[Sampled | RowFailed]: ...


@dataclass(slots=True, frozen=True)
class KVShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> KVShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, heads, kv_heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Keys and values of every layer in one tensor [layers, 2, kv_heads, slots, head_dim].

    Slot s of block b is s + b * block_size. There is one block more than the pool hands out: a scratch block
    that padded rows write to and read from, so that padding never touches anyone's KV.
    """

    def __init__(
        self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        s = shape
        self.tensor = torch.zeros(s.num_layers, 2, s.num_kv_heads, slots, s.head_dim, dtype=dtype, device=device)

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy-on-write of a shared, partly filled block) in every layer, K and V."""
        bs = self.block_size
        for src, dst in copies:
            self.tensor[:, :, :, dst * bs : (dst + 1) * bs] = self.tensor[:, :, :, src * bs : (src + 1) * bs]


def blocks_for_budget(budget_bytes: float, shape: KVShape, dtype: torch.dtype, block_size: int) -> int:
    """How many KV blocks fit in `budget_bytes` (at least one)."""
    return max(1, int(budget_bytes // (shape.bytes_per_token(dtype) * block_size)))
