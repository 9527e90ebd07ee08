"""Pieces shared by the two `model.generate` baselines: per-token timestamps and per-row cancellation."""

from __future__ import annotations

import threading
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from benchmarks.loadgen import RequestRecord
from llmserve.engine.types.model import LoadedModel


class TimestampStreamer(BaseStreamer):
    """Stamps each generated token of each row of a batch into that row's record as `generate` emits it.

    `generate` first puts the prompt (skipped), then one token per row per step. Rows whose request was
    cancelled stop collecting.
    """

    def __init__(self, records: list[RequestRecord], cancelled: list[threading.Event]) -> None:
        self.records = records
        self.cancelled = cancelled
        self.saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.saw_prompt:
            self.saw_prompt = True
            return
        now = time.perf_counter()
        for record, cancelled in zip(self.records, self.cancelled, strict=True):
            if not cancelled.is_set():
                record.token_times.append(now)

    def end(self) -> None:
        pass


class StopCancelledRows(StoppingCriteria):
    """Finishes the rows whose request was cancelled; `generate` returns once every row is finished."""

    def __init__(self, cancelled: list[threading.Event]) -> None:
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        flags = [c.is_set() for c in self.cancelled]
        return torch.tensor(flags, dtype=torch.bool, device=input_ids.device)


def pad_token_id(loaded: LoadedModel) -> int:
    """The id used for left padding: the model's pad id, else its first EOS id, else 0."""
    pad = getattr(loaded.model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = loaded.eos_token_ids[0] if loaded.eos_token_ids else 0
    return int(pad if isinstance(pad, int) else pad[0])


def left_padded(prompts: list[tuple[int, ...]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask for a batch, padded on the left to the longest prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def generate_rows(
    loaded: LoadedModel,
    prompts: list[tuple[int, ...]],
    max_new_tokens: int,
    records: list[RequestRecord],
    cancelled: list[threading.Event],
) -> None:
    """One `model.generate` call over a left-padded batch, greedy, exactly `max_new_tokens` per row."""
    pad = pad_token_id(loaded)
    ids, mask = left_padded(prompts, pad, loaded.device)
    loaded.model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,  # EOS ignored: every system does the same work
        do_sample=False,
        pad_token_id=pad,
        streamer=TimestampStreamer(records, cancelled),
        stopping_criteria=StoppingCriteriaList([StopCancelledRows(cancelled)]),
    )
