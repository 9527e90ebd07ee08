"""What the front end knows of an engine core without asking it: its fixed facts, and the check of a request
against them.

The core states its facts once (`EngineCore.facts`); a core in a process of its own (core_process.py) sends them
at start-up. Either way the front end validates a request against them on the caller's thread, before anything
is queued. Nothing here imports torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llmserve.engine.block_pool import blocks_for
from llmserve.engine.errors import InvalidRequest
from llmserve.engine.lora.catalog import AdapterAnswer
from llmserve.engine.request import GenerationRequest

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class CoreFacts:
    max_model_len: int  # the context cap: the model's, the flag's or the sliding window's, whichever is least
    sliding_window: int | None
    vocab_size: int
    num_blocks: int  # the KV pool's
    block_size: int
    max_top_logprobs: int
    max_n: int
    backend_name: str
    backend_description: str
    lora: AdapterAnswer | None = None  # the adapters at start and the LoRA limits; None when LoRA is off


def validate(request: GenerationRequest, facts: CoreFacts) -> None:
    """Raise InvalidRequest naming the field when `request` cannot be served by this core."""
    request.validate(facts.vocab_size, facts.max_model_len, facts.max_top_logprobs, facts.max_n)
    total = len(request.prompt_token_ids) + request.stopping.max_new_tokens
    if blocks_for(total, facts.block_size) > facts.num_blocks:
        raise InvalidRequest(
            "stopping.max_new_tokens",
            f"prompt + max_new_tokens = {total} tokens never fits the KV pool "
            f"({facts.num_blocks * facts.block_size} tokens)",
        )


def context_cap(flag: int | None, model: int, sliding_window: int | None) -> int:
    """The context a core serves: the model's, capped by --max-model-len (`flag`) and by the sliding window."""
    cap = min(flag or model, model)
    if sliding_window is not None and sliding_window < cap:
        # The paged attention attends over the whole context: stay where that equals the window's.
        log.warning(
            "context capped at %d tokens by the model's sliding window (the paged attention attends to the "
            "whole context, which equals the window's only up to there)",
            sliding_window,
        )
        return sliding_window
    return cap
