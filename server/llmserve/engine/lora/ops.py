"""The batched LoRA delta of one step: y += scale * (x A^T) B^T for every row, each with its own adapter.

A step's rows (tokens: one per decode sequence, a run per prompt chunk) each name a device slot, or NO_ADAPTER
for the base model. `LoraRows` is built once per step from those slots and serves every linear of every layer;
`add_lora` adds one linear's deltas (weights.StackedProjection: every slot's factors stacked) two ways at once:
- runs of at least SEGMENT_ROWS consecutive rows of one adapter (a prompt chunk) are *segments*: a contiguous
  slice of rows times that slot's factors, two matmuls each (what Punica/vLLM call sgmv);
- the other adapter rows (decodes, short chunks) are *grouped*: gathered by slot into one
  [slots, rows of the largest group, in] batch, one bmm with the slots' A, one with their B, added back by index
  (a batched gather-and-multiply, as vLLM's bgmv, but gathering the rows rather than every row's weights).
Base rows take part in neither, so they cost nothing; a step without adapter rows has no `LoraRows` (`of` returns
None) and its forward adds nothing; a linear that no adapter of the step targets is skipped.

Chosen by measurement (benchmarks/probes/lora_ops.py, retired, last at 8f85198; figures in benchmarks/README.md, Lab
notebook: LoRA ops), at SmolLM2-135M's projections with 4 adapters of rank 16, against three other ways over the same
rows: gathering each row's A and B and a bmm per row (vLLM's torch `bgmv_shrink/expand`), per-adapter segments over
gathered rows (`sgmv` on an unsorted batch), and one masked matmul over every slot's stacked factors. Grouped rows were
the fastest for 32 decode rows, contiguous segments for prompt chunks; a short group pads to the largest one, which a
long chunk would make costly, hence the split.

Padding entries of a group read a real row of their own group (or, for a slot without rows inside the span, the
first grouped row) and their outputs are never read back: each real entry's output is gathered back to its row
(`y += out[back]` when every row of the step is grouped, else an index_add of the real entries alone), so a
non-finite row can spoil only its own output. Gathering back beat the padded index_add with its padding zeroed by a
multiply (one scatter_add over every entry, ~30 us a call at 32 decode rows; benchmarks/probes/lora_step.py, retired,
last at 8f85198).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llmserve.engine.lora.weights import StackedProjection
from llmserve.engine.sched.plan import NO_ADAPTER  # a base row's slot

__all__ = ["NO_ADAPTER", "LoraRows", "add_lora"]
# Rows of one adapter in a row from which they form a segment (sliced, not gathered). A decode step's groups are
# a few rows each; a prompt chunk is tens to hundreds.
SEGMENT_ROWS = 32


@dataclass(slots=True, frozen=True)
class Grouped:
    """The gathered rows: `index` [groups * longest] (row of each entry, padding included), slots [lo, hi) as the
    groups. Back: `back` [rows], each row's entry, when every row of the step is grouped (None otherwise); else
    `real` (the real entries) and `dest` (their rows)."""

    index: torch.Tensor
    lo: int
    hi: int
    longest: int
    back: torch.Tensor | None
    real: torch.Tensor
    dest: torch.Tensor


@dataclass(slots=True)
class LoraRows:
    """One step's rows as the LoRA ops read them: who is grouped, which runs are segments, which slots appear."""

    num_rows: int
    present: frozenset[int]  # the slots some row uses
    grouped: Grouped | None
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, end row, slot)

    @classmethod
    def of(
        cls,
        slots: Sequence[int] | torch.Tensor,
        num_slots: int,
        device: torch.device | str = "cpu",
        segment_rows: int = SEGMENT_ROWS,
    ) -> LoraRows | None:
        """The rows of a step from each row's slot (NO_ADAPTER: base), or None when no row has an adapter."""
        row_slots = [int(s) for s in (slots.tolist() if isinstance(slots, torch.Tensor) else slots)]
        present = frozenset(s for s in row_slots if s != NO_ADAPTER)
        if not present:
            return None
        if min(present) < 0 or max(present) >= num_slots:
            raise ValueError(f"row slots {sorted(present)} outside [0, {num_slots}) and {NO_ADAPTER}")
        segments: list[tuple[int, int, int]] = []
        groups: dict[int, list[int]] = {}
        start = 0
        for i in range(1, len(row_slots) + 1):
            if i < len(row_slots) and row_slots[i] == row_slots[start]:
                continue
            slot = row_slots[start]
            if slot != NO_ADAPTER:
                if i - start >= segment_rows:
                    segments.append((start, i, slot))
                else:
                    groups.setdefault(slot, []).extend(range(start, i))
            start = i
        grouped = _grouped(groups, len(row_slots), device) if groups else None
        return cls(len(row_slots), present, grouped, segments)


def _grouped(groups: dict[int, list[int]], num_rows: int, device: torch.device | str) -> Grouped:
    lo, hi = min(groups), max(groups) + 1
    longest = max(len(rows) for rows in groups.values())
    anyone = next(iter(groups.values()))[0]
    index: list[int] = []
    real: list[int] = []
    dest: list[int] = []
    for slot in range(lo, hi):
        rows = groups.get(slot, [])
        pad = rows[0] if rows else anyone
        real += range(len(index), len(index) + len(rows))
        dest += rows
        index += rows + [pad] * (longest - len(rows))
    back = None
    if len(dest) == num_rows:  # every row grouped: each row's entry, to gather the outputs back in row order
        entry_of = [0] * num_rows
        for entry, row in zip(real, dest, strict=True):
            entry_of[row] = entry
        back = _longs(entry_of, device)
    return Grouped(_longs(index, device), lo, hi, longest, back, _longs(real, device), _longs(dest, device))


def _longs(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def add_lora(x: torch.Tensor, y: torch.Tensor, projection: StackedProjection, rows: LoraRows) -> None:
    """y [rows, out] += each row's delta of this linear, in place; x [rows, in] is the linear's input."""
    if projection.targeted.isdisjoint(rows.present):
        return
    rank, columns = projection.rank, projection.columns
    single = len(columns) == 1
    grouped = rows.grouped
    if grouped is not None:
        span = slice(grouped.lo, grouped.hi)
        gathered = x.index_select(0, grouped.index).view(grouped.hi - grouped.lo, grouped.longest, x.shape[1])
        shrunk = torch.bmm(gathered, projection.at[span])
        if single:
            out = torch.bmm(shrunk, projection.bts[0][span])
        else:
            # One index_add over the whole output: into column slices it took twice as long (gate/up, 32 rows; a
            # one-off variant of the probe).
            parts = [
                torch.bmm(shrunk[:, :, i * rank : (i + 1) * rank], bt[span]) for i, bt in enumerate(projection.bts)
            ]
            out = torch.cat(parts, dim=2)
        out = out.view(-1, y.shape[1])
        if grouped.back is not None:
            y.add_(out.index_select(0, grouped.back))
        else:
            y.index_add_(0, grouped.dest, out.index_select(0, grouped.real))
    for r0, r1, slot in rows.segments:
        if slot not in projection.targeted:
            continue
        shrunk = torch.mm(x[r0:r1], projection.at[slot])
        for i, (c0, c1) in enumerate(columns):  # into column slices: faster here than one add of the parts
            part = shrunk if single else shrunk[:, i * rank : (i + 1) * rank]
            y[r0:r1, c0:c1].addmm_(part, projection.bts[i][slot])
