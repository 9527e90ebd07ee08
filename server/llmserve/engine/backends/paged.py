"""The paged step every decoder backend runs, as collaborators each backend builds once with its own choices.

- `Packer`: a plan's entries into one packed row for the forward (`Packed`): input ids, positions, the rows to keep
  logits of, the attention metadata of the backend's kernel and the LoRA rows. With the Triton varlen kernel a
  step's inputs live in device buffers allocated once (step_buffers.py: packed in row order, staged on the host and
  sent with three non-blocking copies); otherwise a metadata builder (metadata.py) packs one-token (decode) entries
  first, shortest context first, then entries that verify drafts, then prompt chunks. Both read the persistent
  input batch (input_batch.py).
- `ModelForward`: the model on a packed row. `TransformersForward` runs transformers' modules (LoRA through hooks
  on its projections); the CPU backend's fused forward is another (cpu/backend.py).
- `PagedStep`: `execute` (the plan's block copies and LoRA writes, one forward, then each row's sampled token,
  pooled vector or prompt logprobs) and what a sequence keeps between steps (`SequenceStates`: its random stream,
  its pooling and its prompt logprobs between prompt chunks), dropped whole by `release`.

The CPU, torch and CUDA backends each hold one of each (the CUDA backend hands `PagedStep` its own way to the
logits: graphs for decode steps); none derives from another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from llmserve.engine.backends.attention import AttentionMetadata
from llmserve.engine.backends.base import KVCache
from llmserve.engine.backends.input_batch import InputBatch
from llmserve.engine.backends.lora_slots import BackendLora
from llmserve.engine.backends.metadata import MetadataBuilder
from llmserve.engine.backends.pooling import DenseStack, PoolingState, end_vectors, pooled_rows
from llmserve.engine.backends.prompt_logprobs import score
from llmserve.engine.backends.step_buffers import StepBuffers
from llmserve.engine.config import EngineConfig
from llmserve.engine.lora.ops import LoraRows
from llmserve.engine.sample.sampler import RowFailed, Sampled, sample_each
from llmserve.engine.sample.streams import RandomStreams, StreamMark
from llmserve.engine.sched.plan import Pooled, SeqStep, StepPlan
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.model import ClassifierHead, LoadedModel
from llmserve.engine.types.outputs import TokenLogprob
from llmserve.engine.types.pooling import PoolingMode
from llmserve.engine.types.request import PoolingParams


class Packed(NamedTuple):
    """A step's packed row, ready for the forward: input ids and positions [1, tokens], the rows to keep logits of,
    the attention metadata, and the LoRA rows (None: no adapter in the step)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    batch: AttentionMetadata
    lora: LoraRows | None
    spans: np.ndarray | None = None  # [entries, 2]: each plan entry's packed rows [first, last) (eager path only)


class ModelForward(Protocol):
    """The model on a packed row."""

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None,
        batch: AttentionMetadata,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """Logits of the `keep` positions (all when None) as float32; `lora`: the rows' adapter slots."""
        ...

    def pooled(self, packed: Packed, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the `keep` rows and the final hidden states (after the model's final norm, what its LM head
        reads) of the `pool` rows, both float32."""
        ...


class TransformersForward:
    """transformers' own modules on a packed row (the paged attention function registered for them by the
    backend); LoRA deltas through `lora`'s hooks on the projections."""

    def __init__(self, model: Any, lora: BackendLora | None) -> None:
        self.model = model
        self.lora = lora

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None,
        batch: AttentionMetadata,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        if lora is not None:
            assert self.lora is not None
            with self.lora.applied(lora):
                return self.logits(input_ids, position_ids, keep, batch)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=0 if keep is None else keep,
            llmserve_batch=batch,
        )
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def pooled(self, packed: Packed, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if packed.lora is not None:
            assert self.lora is not None
            with self.lora.applied(packed.lora):
                return self.pooled(packed._replace(lora=None), pool)
        out = self.model.model(
            input_ids=packed.input_ids,
            position_ids=packed.positions,
            use_cache=False,
            llmserve_batch=packed.batch,
        )
        hidden = out.last_hidden_state[0]
        logits: torch.Tensor = self.model.lm_head(hidden.index_select(0, packed.keep)).float()
        return logits, hidden.index_select(0, pool).float()


class Packer:
    """A plan's entries into one packed row: through `steps` (the varlen kernel's device buffers) when given, else
    through `attention` (a metadata builder over `inputs`); each token's LoRA slot from `lora`."""

    def __init__(
        self,
        inputs: InputBatch,
        attention: MetadataBuilder,
        lora: BackendLora | None,
        device: torch.device,
        steps: StepBuffers | None = None,
    ) -> None:
        self.inputs = inputs
        self.attention = attention
        self.lora = lora
        self.device = device
        self.steps = steps

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


def _kind(entry: SeqStep) -> int:
    """Packing order: one-token entries, then entries that verify drafts, then prompt chunks."""
    return 0 if len(entry.token_ids) == 1 else 1 if entry.drafts else 2


def packed_logits(packer: Packer, forward: ModelForward, plan: StepPlan) -> torch.Tensor:
    """One forward over the plan; logits [sum of num_logits, vocab] as float32, in plan.sampling order (every
    position of an entry with drafts, the last one of the others)."""
    packed = packer.prepare(plan)
    return forward.logits(packed.input_ids, packed.positions, packed.keep, packed.batch, packed.lora)


class SequenceStates:
    """What a paged step keeps of each sequence between steps, by sequence key: its random stream (from its first
    sample to its end, across preemption), its pooling while its prompt is read in chunks (one `PoolingState`, to
    the chunk that ends the prompt: `take_pooled`), and its prompt logprobs likewise (`take_scores`). `release`
    drops all of a sequence's at once: the core calls it when the sequence has ended and no step in flight reads it
    any more. A chunk that starts at position 0 (again, after a preemption) restarts what an earlier attempt added.
    """

    __slots__ = ("streams", "_pooling", "_scores")

    def __init__(self, device: torch.device) -> None:
        self.streams = RandomStreams(device)
        self._pooling: dict[int, PoolingState] = {}
        self._scores: dict[int, list[TokenLogprob]] = {}

    def __len__(self) -> int:
        """How many sequences hold anything here."""
        return len(self._pooling.keys() | self._scores.keys() | set(self.streams))

    def add_pooled(self, key: int, mode: PoolingMode, chunk: torch.Tensor, *, restart: bool) -> None:
        """A chunk's rows for `key` (none: a chunk whose rows this pooling does not read)."""
        state = self._pooling.get(key)
        if state is None or restart or state.mode is not mode:
            state = self._pooling[key] = PoolingState(mode)
        if chunk.shape[0]:
            state.add(chunk)

    def take_pooled(self, key: int) -> torch.Tensor:
        """The pooled vector [H] of `key`'s whole prompt (float32), its state dropped."""
        return self._pooling.pop(key).result(torch.float32)

    def add_scores(self, key: int, scores: list[TokenLogprob], *, restart: bool) -> None:
        """A chunk's prompt logprobs for `key`, in prompt order."""
        if restart or key not in self._scores:
            self._scores[key] = []
        self._scores[key].extend(scores)

    def take_scores(self, key: int) -> list[TokenLogprob]:
        """Every prompt logprob of `key`'s prompt, its list dropped."""
        return self._scores.pop(key, [])

    def release(self, key: int) -> None:
        """Drop everything of `key` (none held is fine: greedy, never pooled or scored, or released already)."""
        self.streams.release(key)
        self._pooling.pop(key, None)
        self._scores.pop(key, None)


class PagedStep:
    """One step of a decoder backend: the plan's block copies and LoRA writes, one forward, then one result per
    sampling row (see base.Backend). `logits`: how a plain step's logits are had (default: `packer` then
    `forward`, `packed_logits`); steps that pool or score prompt rows always run eagerly through both."""

    def __init__(
        self,
        kv: KVCache,
        packer: Packer,
        forward: ModelForward,
        lora: BackendLora | None,
        *,
        device: torch.device,
        dense: DenseStack,
        head: ClassifierHead | None,
        logits: Callable[[StepPlan], torch.Tensor] | None = None,
    ) -> None:
        self.kv = kv
        self.packer = packer
        self.forward = forward
        self.lora = lora
        self.device = device
        self.dense = dense  # a pooling folder's Dense projections (none for --pooling alone)
        self.head = head  # a classifier's score head over the last token's final hidden state; None otherwise
        self.logits = logits if logits is not None else self._logits
        self.states = SequenceStates(device)

    def _logits(self, plan: StepPlan) -> torch.Tensor:
        return packed_logits(self.packer, self.forward, plan)

    def release(self, key: int) -> None:
        self.states.release(key)

    def mark_stream(self, row: SampleRow) -> StreamMark:
        return self.states.streams.mark(row)

    def rewind_stream(self, key: int, seed: int, draws: int) -> None:
        self.states.streams.rewind(key, seed, draws)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[Sampled | RowFailed | Pooled]:
        if plan.copies:
            self.kv.copy_blocks(plan.copies)
        if plan.lora_writes:
            assert self.lora is not None, "a plan with LoRA writes for a backend without LoRA slots"
            self.lora.write(plan.lora_writes)
        if any(entry.seq.request.pooling is not None or entry.scored_positions is not None for entry in plan.seqs):
            return self._execute_eager(plan)
        return list(sample_each(self.logits(plan), plan.sample_rows(), self.states.streams))

    def _execute_eager(self, plan: StepPlan) -> list[Sampled | RowFailed | Pooled]:
        """A step that needs more than the sampling rows' logits, eagerly: pooling requests' prompt chunks, or prompt
        chunks of requests that ask for prompt logprobs, beside anything else. One forward gives the logits of the
        scored prompt rows, then of the sampling rows, and (with pooling) the final hidden states (after the final
        norm) of the rows the poolings read. Each pooling request's chunk goes into its state, and the chunk that
        ends its prompt gives its vector (`Pooled`, in the place of a sampled token: it samples nothing); each scored
        chunk's logprobs go into the request's list, which the chunk that ends its prompt attaches to its first
        sampled token (`Sampled.prompt`). Only the requests that ask have prompt rows of logits computed."""
        packed = self.packer.prepare(plan, eager=True)
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
            logits, hidden = self.forward.pooled(packed, pool)
        else:
            logits = self.forward.logits(packed.input_ids, packed.positions, packed.keep, packed.batch, packed.lora)
        prompts = self._score_prompts(logits[:scored], scoring)
        logits = logits[scored:]
        vectors: dict[int, Pooled | RowFailed] = {}
        at = 0
        for entry, n in takes:
            seq, params = entry.seq, entry.seq.request.pooling
            assert params is not None
            self.states.add_pooled(seq.seq_no, params.mode, hidden[at : at + n], restart=entry.start == 0)
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
        sampled = iter(sample_each(logits, sample_rows, self.states.streams) if sample_rows else [])
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
            self.states.add_scores(key, [next(scores) for _ in positions], restart=entry.start == 0)
            if entry.sample is not None:
                done[key] = self.states.take_scores(key)
        return done

    def _vector(self, key: int, params: PoolingParams) -> Pooled | RowFailed:
        try:
            vector = end_vectors(self.states.take_pooled(key)[None], params, head=self.head, dense=self.dense)[0]
        except ValueError as exc:
            return RowFailed(str(exc))
        return Pooled(vector.tolist())


def paged_inputs(config: EngineConfig, kv: KVCache, max_model_len: int, device: torch.device) -> InputBatch:
    """The persistent input batch of a paged backend: a row per running sequence, each of up to `max_model_len`'s
    blocks (pinned on CUDA: the copies to the device run asynchronously)."""
    max_blocks = -(-max_model_len // config.block_size)
    pin = device.type == "cuda"
    return InputBatch(config.max_num_seqs, max_blocks, config.block_size, kv.scratch_block, kv.scratch_slot, pin=pin)


def paged_step(
    loaded: LoadedModel,
    kv: KVCache,
    packer: Packer,
    forward: ModelForward,
    lora: BackendLora | None,
    logits: Callable[[StepPlan], torch.Tensor] | None = None,
) -> PagedStep:
    """The paged step over a loaded model: with its pooling folder's Dense projections (none for --pooling alone)
    and a classifier's score head (models.as_classifier; None otherwise)."""
    dense = DenseStack.load(loaded.pooling.dense if loaded.pooling is not None else (), torch.float32, loaded.device)
    return PagedStep(kv, packer, forward, lora, device=loaded.device, dense=dense, head=loaded.head, logits=logits)
