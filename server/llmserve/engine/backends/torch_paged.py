"""The generic backend: any transformers causal LM, CPU or CUDA, through the paged attention function.

A backend is composed of parts it is given or picks once when it is built: the KV cache (sized and allocated
before, `create_backend`), the persistent input batch (input_batch.py: a row per running sequence, updated
incrementally), the step's inputs for its kernel, and the model's forward. With the Triton varlen kernel a step's
inputs live in device buffers allocated once (step_buffers.py: packed in row order, staged on the host and sent
with three non-blocking copies); with the torch attention a metadata builder (metadata.py) packs one-token
(decode) entries first, shortest context first, then prompt chunks. The CPU and CUDA backends compose other parts
(the compiled decode kernel and the fused forward; the CUDA graphs) around the same pieces.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from llmserve.engine.backends.attention import ATTN_IMPLEMENTATION, AttentionMetadata, VarlenKernel, register_attention
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.input_batch import InputBatch
from llmserve.engine.backends.lora_slots import BackendLora
from llmserve.engine.backends.metadata import GatheredBuilder, MetadataBuilder
from llmserve.engine.backends.pooling import DenseStack, PoolingStates, end_vectors, pooled_rows
from llmserve.engine.backends.prompt_logprobs import PromptScores, score
from llmserve.engine.backends.step_buffers import StepBuffers
from llmserve.engine.config import EngineConfig
from llmserve.engine.lora.ops import LoraRows
from llmserve.engine.sample.sampler import RowFailed, Sampled, sample_each
from llmserve.engine.sample.streams import RandomStreams
from llmserve.engine.sched.plan import Pooled, SeqStep, StepPlan
from llmserve.engine.types.model import ClassifierHead, LoadedModel
from llmserve.engine.types.outputs import TokenLogprob
from llmserve.engine.types.request import PoolingParams


class Packed(NamedTuple):
    """A step's packed row, ready for `forward`: input ids and positions [1, tokens], the rows to keep logits of,
    the attention metadata, and the LoRA rows (None: no adapter in the step)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    batch: AttentionMetadata
    lora: LoraRows | None
    spans: np.ndarray | None = None  # [entries, 2]: each plan entry's packed rows [first, last) (eager path only)


class TorchPagedBackend:
    """Owns the model, the KV cache and the input batch; `execute` runs one packed forward per plan and samples
    its rows."""

    name = "torch"

    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv: KVCache, max_model_len: int) -> None:
        model = loaded.model
        self.model = model
        self.config = config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.shape = loaded.shape
        register_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.kv = kv
        self.num_blocks = kv.num_blocks
        self.streams = RandomStreams(self.device)  # each sampled sequence's stream, from step to step
        pin = self.device.type == "cuda"  # page-locked: the copies to the device run asynchronously
        max_blocks = -(-max_model_len // self.block_size)
        self.inputs = InputBatch(
            config.max_num_seqs, max_blocks, self.block_size, kv.scratch_block, kv.scratch_slot, pin=pin
        )
        self.varlen_kernel = varlen_kernel(config.attention_kernel, self.device)
        # The varlen kernel's steps read persistent device buffers; the torch attention's, a builder's metadata.
        self.steps: StepBuffers | None = None
        self.attention: MetadataBuilder = GatheredBuilder(self.inputs, kv, self.dtype)
        if self.varlen_kernel is not None:
            self.steps = StepBuffers(self.inputs, kv, self.varlen_kernel, config.max_num_batched_tokens)
        attention = "one Triton varlen kernel" if self.varlen_kernel is not None else "torch"
        self.description = f"transformers layers, paged attention in {attention}"
        # LoRA slots (None unless the config serves adapters), applied by hooks on the model's projections.
        self.lora = BackendLora.of(config, self.shape, model, self.dtype, self.device, fused=False)
        # Pooling requests (Embed on a generative model, --pooling): their states between chunks, and the folder's
        # Dense projections (none for --pooling alone).
        self.pooling = PoolingStates()
        dense = loaded.pooling.dense if loaded.pooling is not None else ()
        self.dense = DenseStack.load(dense, torch.float32, self.device)
        # A classifier's score head (models.as_classifier), over the last token's final hidden state; None otherwise.
        self.head: ClassifierHead | None = loaded.head
        self.prompt_scores = PromptScores()  # prompt logprobs between a request's prompt chunks

    # -- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[Sampled | RowFailed | Pooled]:
        self.kv.copy_blocks(plan.copies)
        if plan.lora_writes:
            assert self.lora is not None, "a plan with LoRA writes for a backend without LoRA slots"
            self.lora.write(plan.lora_writes)
        if any(entry.seq.request.pooling is not None or entry.scored_positions is not None for entry in plan.seqs):
            return self._execute_eager(plan)
        logits = self.logits(plan)
        return list(sample_each(logits, plan.sample_rows(), self.streams))

    def _execute_eager(self, plan: StepPlan) -> list[Sampled | RowFailed | Pooled]:
        """A step that needs more than the sampling rows' logits, eagerly: pooling requests' prompt chunks, or prompt
        chunks of requests that ask for prompt logprobs, beside anything else. One forward gives the logits of the
        scored prompt rows, then of the sampling rows, and (with pooling) the final hidden states (after the final
        norm) of the rows the poolings read. Each pooling request's chunk goes into its state, and the chunk that
        ends its prompt gives its vector (`Pooled`, in the place of a sampled token: it samples nothing); each scored
        chunk's logprobs go into the request's list, which the chunk that ends its prompt attaches to its first
        sampled token (`Sampled.prompt`). Only the requests that ask have prompt rows of logits computed."""
        packed = self.prepare(plan, eager=True)
        assert packed.spans is not None
        pool_index: list[int] = []
        takes: list[tuple[SeqStep, int]] = []
        score_index: list[int] = []
        scoring: list[tuple[SeqStep, range]] = []
        for entry, (first, last) in zip(plan.seqs, packed.spans.tolist(), strict=True):
            params = entry.seq.request.pooling
            if params is not None:
                rows = pooled_rows(params.mode, entry.start, first, last, entry.sample is not None)
                pool_index.extend(rows)
                takes.append((entry, len(rows)))
            elif (positions := entry.scored_positions) is not None:
                score_index.extend(range(first, first + len(positions)))
                scoring.append((entry, positions))
        scored = len(score_index)
        if scored:
            scored_rows = torch.tensor(score_index, dtype=torch.int64, device=self.device)
            packed = packed._replace(keep=torch.cat([scored_rows, packed.keep]))
        if takes:
            pool = torch.tensor(pool_index, dtype=torch.int64, device=self.device)
            logits, hidden = self.forward_pooling(packed, pool)
        else:
            logits = self.forward(packed.input_ids, packed.positions, packed.keep, packed.batch, packed.lora)
        prompts = self._score_prompts(logits[:scored], scoring)
        logits = logits[scored:]
        vectors: dict[int, Pooled | RowFailed] = {}
        at = 0
        for entry, n in takes:
            seq, params = entry.seq, entry.seq.request.pooling
            assert params is not None
            self.pooling.add(seq.seq_no, params.mode, hidden[at : at + n], restart=entry.start == 0)
            at += n
            if entry.sample is not None:
                vectors[seq.seq_no] = self._vector(seq.seq_no, params)
        if takes and any(entry.drafts for entry in plan.seqs):
            raise ValueError("a step with drafts holds no pooling request")
        sample_rows = (
            plan.sample_rows()
            if not takes
            else [e.sample for e in plan.seqs if e.sample is not None and e.seq.request.pooling is None]
        )
        sampled = iter(sample_each(logits, sample_rows, self.streams) if sample_rows else [])
        results: list[Sampled | RowFailed | Pooled] = []
        for entry in plan.sampling:
            key = entry.seq.seq_no
            if entry.seq.request.pooling is not None:
                results.append(vectors[key])
                continue
            for _ in range(entry.num_logits):
                result = next(sampled)
                if key in prompts and isinstance(result, Sampled):
                    result = replace(result, prompt=prompts[key])
                results.append(result)
        return results

    def _score_prompts(
        self, logits: torch.Tensor, scoring: list[tuple[SeqStep, range]]
    ) -> dict[int, list[TokenLogprob]]:
        """Each scored chunk's prompt logprobs into its request's list (`logits`: the chunks' rows, in order); the
        whole lists of the requests whose prompt this step ends, by sequence key."""
        targets: list[int] = []
        tops: list[int] = []
        for entry, positions in scoring:
            seq = entry.seq
            targets.extend(seq.token_ids[p + 1] for p in positions)
            tops.extend([seq.request.prompt_top_logprobs] * len(positions))
        scores = iter(score(logits, targets, tops))
        done: dict[int, list[TokenLogprob]] = {}
        for entry, positions in scoring:
            key = entry.seq.seq_no
            self.prompt_scores.add(key, [next(scores) for _ in positions], restart=entry.start == 0)
            if entry.sample is not None:
                done[key] = self.prompt_scores.take(key)
        return done

    def _vector(self, key: int, params: PoolingParams) -> Pooled | RowFailed:
        try:
            vector = end_vectors(self.pooling.take(key)[None], params, head=self.head, dense=self.dense)[0]
        except ValueError as exc:
            return RowFailed(str(exc))
        return Pooled(vector.tolist())

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """One forward over the plan; logits [sum of num_logits, vocab] as float32, in plan.sampling order (every
        position of an entry with drafts, the last one of the others)."""
        packed = self.prepare(plan)
        return self.forward(packed.input_ids, packed.positions, packed.keep, packed.batch, packed.lora)

    def prepare(self, plan: StepPlan, *, eager: bool = False) -> Packed:
        """The packed row: input ids, positions, the rows to keep logits of, the attention metadata, LoRA rows
        (each token's slot: a sequence's drafts compute with its adapter like its last token). `eager`: packed by a
        metadata builder whatever the kernel, with each entry's span, and no logits kept for pooling entries."""
        if self.steps is not None and not eager and not any(entry.drafts for entry in plan.seqs):  # drafts: all
            step = self.steps.stage(plan.seqs)
            lora = None
            if self.lora is not None:  # the step buffers pack the entries by their input-batch row
                row_of = self.steps.rows
                lora = self.lora.rows([plan.seqs[i] for i in sorted(range(len(row_of)), key=row_of.__getitem__)])
            return Packed(step.input_ids, step.positions, step.keep, step.attention, lora)
        entries = plan.seqs
        # One-token entries first, shortest context first: the decode attention batches them by length; then the
        # entries that verify drafts (a decode kernel may take them as one query row per position), then chunks.
        order = sorted(range(len(entries)), key=lambda i: (_kind(entries[i]), entries[i].start))
        staged = self.inputs.stage([entries[i] for i in order])
        dev = self.device
        batch = self.attention.build(staged, staged.slots.to(dev))
        # Each entry's last token's row in the packed row, in plan order; kept for the entries that sample (every
        # position's row for those with drafts).
        last = np.empty(len(entries), dtype=np.int64)
        last[order] = staged.query_start[1:] - 1
        sampling = [
            i
            for i, entry in enumerate(entries)
            if entry.sample is not None and (not eager or entry.seq.request.pooling is None)
        ]
        if any(entries[i].drafts for i in sampling):
            rows = [np.arange(last[i] - len(entries[i].drafts), last[i] + 1) for i in sampling]
            keep = torch.from_numpy(np.concatenate(rows)).to(dev)
        else:
            keep = torch.from_numpy(last[sampling]).to(dev)
        lora = None if self.lora is None else self.lora.rows(staged.entries)
        spans = None
        if eager:
            spans = np.empty((len(entries), 2), dtype=np.int64)
            spans[order, 0] = staged.query_start[:-1]
            spans[:, 1] = last + 1
        return Packed(staged.ids[None].to(dev), staged.positions[None].to(dev), keep, batch, lora, spans)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None,
        batch: AttentionMetadata,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """The model on a packed row; logits of the `keep` positions (all when None) as float32; `lora`: the
        rows' adapter slots (needs the LoRA slots)."""
        if lora is not None:
            assert self.lora is not None
            with self.lora.applied(lora):
                return self.forward(input_ids, position_ids, keep, batch)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=0 if keep is None else keep,
            llmserve_batch=batch,
        )
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def forward_pooling(self, packed: Packed, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model on a packed row: logits of the `keep` rows and the final hidden states (after the model's
        final norm, what its LM head reads) of the `pool` rows, both float32."""
        if packed.lora is not None:
            assert self.lora is not None
            with self.lora.applied(packed.lora):
                return self.forward_pooling(packed._replace(lora=None), pool)
        out = self.model.model(
            input_ids=packed.input_ids,
            position_ids=packed.positions,
            use_cache=False,
            llmserve_batch=packed.batch,
        )
        hidden = out.last_hidden_state[0]
        logits: torch.Tensor = self.model.lm_head(hidden.index_select(0, packed.keep)).float()
        return logits, hidden.index_select(0, pool).float()


def _kind(entry: SeqStep) -> int:
    """Packing order: one-token entries, then entries that verify drafts, then prompt chunks."""
    return 0 if len(entry.token_ids) == 1 else 1 if entry.drafts else 2


def varlen_kernel(choice: str, device: torch.device) -> VarlenKernel | None:
    """The Triton varlen kernel when `choice` asks for it ("triton", or "auto" on CUDA) and Triton imports;
    None for the torch path. "triton" without Triton raises."""
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return None
    try:
        from llmserve.engine.backends.triton_attention import varlen_paged_attention
    except ImportError as exc:
        if choice == "triton":
            raise RuntimeError(f"--attention-kernel triton: Triton is not installed ({exc})") from exc
        return None
    return varlen_paged_attention
