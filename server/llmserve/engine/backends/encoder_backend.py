"""The backend of an encoder model (BERT family): each step's inputs through the encoder's forward as packed rows,
each input's hidden states pooled into its vector. No KV cache, no sampling.

An encoder's requests are pooling requests only (types/request.PoolingParams); the scheduler admits each prompt
whole (Scheduler(whole_prompts=True): bidirectional attention needs every token of an input in one forward) under the
same token budget as a decoder's steps, so that one step is one forward over at most `max_num_batched_tokens` rows
(encoder_batch.py: packed rows, shortest first, attention padded per group of like length). Each entry of a plan is a
whole input; its result is `Pooled`: the hidden states pooled as its request says (pooling.pool), projected by the
folder's Dense modules, cut to its `dimensions` and normalized when asked (pooling.end_vectors), in float32.

The block pool still keeps books for these sequences (it bounds how many inputs are in flight), but its blocks
name no memory: `kv` is a cache of the one scratch block the interface requires, which nothing reads or writes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.cpu.split_linear import Fp32Matmul
from llmserve.engine.backends.encoder_batch import EncoderBatch
from llmserve.engine.backends.pooling import DenseStack, end_vectors, pool
from llmserve.engine.config import EngineConfig
from llmserve.engine.sample.sampler import RowFailed, Sampled
from llmserve.engine.sample.streams import StreamMark
from llmserve.engine.sched.plan import Pooled, StepPlan
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.kv_cache import blocks_for
from llmserve.engine.types.model import ClassifierHead, LoadedModel
from llmserve.engine.types.request import PoolingParams

__all__ = ["EncoderBackend"]


class Encoder(Protocol):
    """What this backend runs of an encoder model (models/encoder.py's BertEncoder): every token's final hidden
    state, [tokens, hidden], packed as the batch is; how its linears multiply, for the description."""

    @property
    def packed(self) -> bool: ...  # float32 weights packed for oneDNN

    @property
    def matmul(self) -> Fp32Matmul: ...

    def __call__(self, batch: EncoderBatch) -> torch.Tensor: ...


class EncoderBackend:
    """Runs an encoder model's steps (see the module docstring). `loaded.model` is the encoder (`loaded.encoder`)
    and `loaded.pooling` its folder's pooling pipeline (models/loader.load_model builds both for an encoder folder)."""

    name = "encoder"

    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> None:
        if not loaded.encoder or loaded.pooling is None:
            raise ValueError(f"{loaded.name}: the encoder backend serves an encoder with its pooling configured")
        self.encoder: Encoder = loaded.model
        self.pipeline = loaded.pooling
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        # Books only: enough blocks that max_num_seqs inputs of the longest length fit at once.
        self.num_blocks = config.max_num_seqs * blocks_for(max_model_len, config.block_size)
        self.kv = KVCache(loaded.shape, 0, config.block_size, self.dtype, self.device)
        self.dense = DenseStack.load(self.pipeline.dense, torch.float32, self.device)
        # A BERT classifier's pooler and classifier (models.load_encoder), over [CLS]; None for an embedding model.
        self.head: ClassifierHead | None = loaded.head
        packed = "oneDNN-packed linears" if self.encoder.packed else "torch linears"
        if self.encoder.matmul is Fp32Matmul.BF16X3:
            packed = "linears as three bfloat16 products on AMX tiles (--fp32-matmul bf16x3)"
        head = "" if self.head is None else f" into a {self.head.num_classes}-class classifier"
        self.description = (
            f"encoder forward over packed rows ({loaded.dtype}, {packed}), "
            f"{self.pipeline.mode.value} pooling{head}, no KV cache"
        )

    def release(self, sequence: int) -> None:
        """Nothing to drop: each input is read whole in one step, and nothing is sampled."""

    def mark_stream(self, row: SampleRow) -> StreamMark:
        raise ValueError("an encoder samples nothing: it keeps no random stream")

    def rewind_stream(self, sequence: int, seed: int, draws: int) -> None:
        raise ValueError("an encoder samples nothing: it keeps no random stream")

    def execute(self, plan: StepPlan) -> list[Sampled | RowFailed | Pooled]:
        """One forward over every entry's whole input; one `Pooled` per entry, in plan order (each samples: it reads
        its last token). Raises when the forward fails; a row whose pooling options fail is that row's failure."""
        entries = plan.seqs
        if any(entry.start != 0 or entry.sample is None for entry in entries):
            raise ValueError("an encoder step computes whole inputs only")
        results: list[Sampled | RowFailed | Pooled | None] = [None] * len(entries)
        # Entries asking the same pooling are pooled, projected and finished together: one call each per step, not
        # per input (per-input calls were most of the step's Python at 32 one-text callers).
        groups: dict[PoolingParams, list[int]] = {}
        for i, entry in enumerate(entries):
            params = entry.seq.request.pooling
            if params is None:
                results[i] = RowFailed("an encoder serves pooling requests only")
            else:
                groups.setdefault(params, []).append(i)
        # Packed shortest first, so that sequences of like length attend together (EncoderBatch.groups); `at[i]`:
        # entry i's place in the packed order.
        order = sorted(range(len(entries)), key=lambda i: len(entries[i].token_ids))
        at = {i: place for place, i in enumerate(order)}
        # A text pair's segments (a cross-encoder's query and document, types/request.py); all segment 0 when no
        # entry of the step has any.
        types = None
        if any(entries[i].seq.request.token_type_ids for i in order):
            types = [entries[i].seq.request.token_type_ids or (0,) * len(entries[i].token_ids) for i in order]
        batch = EncoderBatch.pack([entries[i].token_ids for i in order], types, device=self.device)
        with torch.inference_mode():
            hidden = self.encoder(batch).float()
            rows = hidden.split_with_sizes(list(batch.seq_lens))
            for params, members in groups.items():
                members.sort(key=at.__getitem__)
                lens = [batch.seq_lens[at[i]] for i in members]
                states = hidden if len(members) == len(entries) else torch.cat([rows[at[i]] for i in members])
                try:
                    vectors = end_vectors(pool(states, lens, params.mode), params, head=self.head, dense=self.dense)
                except ValueError as exc:
                    for i in members:
                        results[i] = RowFailed(str(exc))
                    continue
                for i, values in zip(members, vectors.tolist(), strict=True):
                    results[i] = Pooled(values)
        return [result for result in results if result is not None]
