"""Batched next-token sampling with per-request seeds.

One call per engine step picks one token for each row of a [rows, vocab] logits tensor. Greedy rows take
the argmax (bit-for-bit what transformers' greedy search picks). Every row first gets its logit edits, in
vLLM's order: repetition penalty, then the additive ones (frequency and presence penalties over generated
tokens, logit bias), then blocked ids. Sampled rows then follow transformers' order: temperature, top-k,
top-p, min-p, then an inverse-CDF draw with one uniform number from the row's own random stream.

A row names its stream (the sequence's key and seed) and never holds it: the streams are in streams.py's
`RandomStreams`, which each backend owns and passes in, so that the request types stay torch-free.

Batch invariance is the point of the design: a seeded request gets the same tokens whatever else shares
its batch. So randomness never comes from a shared RNG, and a row's arithmetic only uses kernels that
treat rows independently and in a fixed order (elementwise ops, softmax, cumsum, max, top-k values,
searchsorted). Generic sum reductions are avoided, because PyTorch splits a short batch's reduction across
threads and so changes its rounding with the batch size.

No valid request can make a row fail or disturb its neighbours: after each processing stage a row's logits are
made finite or -inf (NaN -> -inf, +inf -> the largest float), the nucleus always keeps the best token, and a row
whose every token is blocked takes the model's best token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

import torch

from llmserve.engine.sample.masks import constraint_masks
from llmserve.engine.sample.streams import RandomStreams
from llmserve.engine.sched.sequence import SampleRow
from llmserve.engine.types.outputs import TokenLogprob
from llmserve.engine.types.request import MAX_TEMPERATURE, PENALTY_RANGE, SamplingParams

__all__ = ["RowFailed", "SampleRow", "Sampled", "sample", "sample_each", "warped_weights", "nucleus_floor"]

log = logging.getLogger(__name__)

# Top-p candidate bins: float32 bits >> 20 keep the exponent and 3 mantissa bits; probabilities <= 1.0
# have bit patterns <= 0x3F800000, so their bins are < 1024.
_BIN_SHIFT = 20
_N_BINS = 1024


@dataclass(slots=True, frozen=True)
class Sampled:
    """One row's pick: the token and, when asked for, its logprobs. `prompt`: on the first token of a request that
    asks for prompt logprobs, those of its whole prompt (the backend's, backends/prompt_logprobs.py)."""

    token_id: int
    logprob: TokenLogprob | None
    prompt: list[TokenLogprob] | None = None


@dataclass(slots=True, frozen=True)
class RowFailed:
    """Sampling this row raised: the failure of its request alone."""

    error: str


def sample_each(logits: torch.Tensor, rows: list[SampleRow], streams: RandomStreams) -> list[Sampled | RowFailed]:
    """`sample`, with each row's failure kept to that row: the batch is sampled at once, and should that raise,
    row by row, so that one request's parameters or penalties fail that request only."""
    try:
        token_ids, logprobs = sample(logits, rows, streams)
        return [Sampled(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]
    except Exception:
        log.exception("batched sampling failed: sampling %d rows one by one", len(rows))
    results: list[Sampled | RowFailed] = []
    for i, row in enumerate(rows):
        try:
            ids, lps = sample(logits[i : i + 1], [row], streams)
            results.append(Sampled(ids[0], lps[0]))
        except Exception as exc:
            results.append(RowFailed(f"sampling failed: {type(exc).__name__}: {exc}"))
    return results


def sample(
    logits: torch.Tensor, rows: list[SampleRow], streams: RandomStreams
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of `logits` ([len(rows), vocab], any device and float dtype).

    Returns the chosen ids, and per row a TokenLogprob when `row.logprobs` (log-softmax of the raw logits:
    the chosen id's logprob and the `top_logprobs` best as (id, logprob), descending), else None.
    Sampled rows draw from their streams in `streams`. Raises ValueError when the shapes disagree or a
    sampled row without a stream has no seed. `logits` is not modified.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, vocab], got {list(logits.shape)}")
    if not rows:
        return [], []
    constrained = [i for i, row in enumerate(rows) if row.constraint is not None]
    if not constrained and all(_plain_greedy(row) for row in rows):
        return logits.argmax(dim=-1).tolist(), [None] * len(rows)

    device = logits.device
    masked = _select(constrained, len(rows), device)
    masks = None
    if masked is not None:
        # First: on CUDA the forward may still be running, and the grammar work on the CPU overlaps with it.
        states = [state for i in constrained if (state := rows[i].constraint) is not None]
        masks = constraint_masks(states, logits.shape[1], device)
    x = logits.to(torch.float32, copy=True)
    if masked is not None and masks is not None:
        _add_rows(x, masked, masks)
    _apply_repetition_penalty(x, rows)
    _apply_additive(x, rows)
    _apply_blocked(x, rows)
    _tame(x)
    # A row with every token blocked has nothing to pick from: it takes the model's best token instead.
    alive = x.amax(dim=-1) > float("-inf")

    chosen = torch.empty(len(rows), dtype=torch.long, device=device)
    greedy = _select([i for i, row in enumerate(rows) if row.params.greedy], len(rows), device)
    if greedy is not None:
        chosen[greedy] = x[greedy].argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    sel = _select(sampled, len(rows), device)
    if sel is not None:
        chosen[sel] = _draw(x[sel], [rows[i] for i in sampled], streams)
    if not bool(alive.all()):
        raw = logits.to(torch.float32, copy=True)
        if masked is not None and masks is not None:  # a constraint still holds: only blocked ids give way
            _add_rows(raw, masked, masks)
        _tame(raw)
        chosen = torch.where(alive, chosen, raw.argmax(dim=-1))
    token_ids = chosen.tolist()
    return token_ids, _logprobs(logits, rows, chosen)


def _add_rows(x: torch.Tensor, sel: torch.Tensor | slice, values: torch.Tensor) -> None:
    if isinstance(sel, slice):
        x.add_(values)
    else:
        x[sel] += values


def _tame(x: torch.Tensor) -> None:
    """NaN -> -inf (never chosen), +inf -> the largest float (softmax of a row holding inf is NaN)."""
    torch.nan_to_num_(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))


def _plain_greedy(row: SampleRow) -> bool:
    return row.params.greedy and not row.params.edits_logits and not row.blocked_token_ids and not row.logprobs


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True)


def _apply_repetition_penalty(x: torch.Tensor, rows: list[SampleRow]) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor, for all penalised rows in one gather/scatter.

    A token seen several times is written several times with the same value, so duplicates are harmless.
    """
    penalised = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0 and row.token_ids]
    if not penalised:
        return
    lengths = torch.tensor([len(rows[i].token_ids) for i in penalised])
    cols = torch.tensor(list(chain.from_iterable(rows[i].token_ids for i in penalised)), dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(penalised, dtype=torch.long), lengths)
    low, high = PENALTY_RANGE
    factors = [min(max(rows[i].params.repetition_penalty, low), high) for i in penalised]
    penalty = torch.repeat_interleave(torch.tensor(factors), lengths)
    row_idx, cols, penalty = (t.to(x.device, non_blocking=True) for t in (row_idx, cols, penalty))
    seen = x[row_idx, cols]
    x[row_idx, cols] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_additive(x: torch.Tensor, rows: list[SampleRow]) -> None:
    """OpenAI's frequency and presence penalties (over generated tokens) and logit bias, for all rows at once.

    Each touched logit gets one subtraction of `count * frequency + presence` (counts are exact integers from
    `unique`), and one addition of its bias: no accumulation whose rounding could depend on the order of
    duplicates or on the batch.
    """
    vocab = x.shape[1]
    penalised = [
        i
        for i, row in enumerate(rows)
        if (row.params.frequency_penalty or row.params.presence_penalty) and len(row.token_ids) > row.num_prompt
    ]
    if penalised:
        generated = [rows[i].token_ids[rows[i].num_prompt :] for i in penalised]
        lengths = torch.tensor([len(g) for g in generated])
        cols = torch.tensor(list(chain.from_iterable(generated)), dtype=torch.long)
        row_idx = torch.repeat_interleave(torch.arange(len(penalised)), lengths)
        keys, counts = torch.unique(row_idx * vocab + cols, return_counts=True)
        local, cols = keys // vocab, keys % vocab
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in penalised], dtype=torch.float32)
        presence = torch.tensor([rows[i].params.presence_penalty for i in penalised], dtype=torch.float32)
        amount = counts.to(torch.float32) * frequency[local] + presence[local]
        rows_at = torch.tensor(penalised, dtype=torch.long)[local]
        rows_at, cols, amount = (t.to(x.device, non_blocking=True) for t in (rows_at, cols, amount))
        x[rows_at, cols] -= amount
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        pairs = [rows[i].params.logit_bias for i in biased]
        lengths = torch.tensor([len(p) for p in pairs])
        row_idx = torch.repeat_interleave(torch.tensor(biased, dtype=torch.long), lengths)
        cols = torch.tensor([t for p in pairs for t, _ in p], dtype=torch.long)
        bias = torch.tensor([b for p in pairs for _, b in p], dtype=torch.float32)
        row_idx, cols, bias = (t.to(x.device, non_blocking=True) for t in (row_idx, cols, bias))
        x[row_idx, cols] += bias


def _apply_blocked(x: torch.Tensor, rows: list[SampleRow]) -> None:
    blocked = [i for i, row in enumerate(rows) if row.blocked_token_ids]
    if not blocked:
        return
    lengths = torch.tensor([len(rows[i].blocked_token_ids) for i in blocked])
    cols = torch.tensor(list(chain.from_iterable(rows[i].blocked_token_ids for i in blocked)), dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(blocked, dtype=torch.long), lengths)
    x[row_idx.to(x.device, non_blocking=True), cols.to(x.device, non_blocking=True)] = float("-inf")


def _draw(x: torch.Tensor, rows: list[SampleRow], streams: RandomStreams) -> torch.Tensor:
    """Sample one id per row of `x` ([m, vocab] float32, owned by us: modified in place)."""
    # Every stream before any draw, so that a row without a seed fails before another row's stream moves on
    # (sample_each then samples the others again, row by row); uniforms before the warping work.
    drawn = [streams.stream(row) for row in rows]
    uniforms = torch.stack([_uniform(generator, x.device) for generator in drawn])
    weights = warped_weights(x, [row.params for row in rows])
    # Inverse CDF over unnormalised weights: the first index whose running total exceeds u * total.
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)
    # u * total can round up to total; the last token with weight is then the right answer.
    last = torch.searchsorted(cdf, total, right=False)
    # The clamp only matters for a row without weight, which sample() replaces anyway.
    return torch.minimum(picked, last).squeeze(1).clamp_(max=x.shape[1] - 1)


def warped_weights(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, in transformers' order, for rows of float32 logits `x`
    (modified in place). Returns [m, vocab] sampling weights: proportional to the warped distribution,
    zero for every token filtered out, not necessarily summing to one."""
    device = x.device
    vocab = x.shape[1]
    n = len(params)
    temperature = torch.tensor([min(p.temperature, MAX_TEMPERATURE) for p in params], dtype=torch.float32)
    x.div_(temperature.to(device, non_blocking=True).unsqueeze(1))
    _tame(x)  # a largest-float logit over a small temperature overflows again

    sel = _select([j for j, p in enumerate(params) if 0 < p.top_k < vocab], n, device)
    if sel is not None:
        ks = [params[j].top_k for j in _positions(sel, n)]
        sub = x[sel]
        kth = sub.topk(max(ks), dim=-1).values.gather(1, _column(ks, torch.long, device) - 1)
        # Ties with the k-th value stay in, as in transformers' TopKLogitsWarper.
        _store(x, sel, sub.masked_fill_(sub < kth, float("-inf")))

    probs = torch.softmax(x, dim=-1)
    sel = _select([j for j, p in enumerate(params) if p.top_p < 1.0], n, device)
    if sel is not None:
        # Below float32's smallest normal a top_p reads as 0; every such value keeps only the best token.
        tiny = torch.finfo(torch.float32).tiny
        ps = _column([max(params[j].top_p, tiny) for j in _positions(sel, n)], torch.float32, device)
        sub = probs[sel]
        _store(probs, sel, sub.masked_fill_(sub < nucleus_floor(sub, ps), 0.0))

    sel = _select([j for j, p in enumerate(params) if p.min_p > 0.0], n, device)
    if sel is not None:
        scale = _column([params[j].min_p for j in _positions(sel, n)], torch.float32, device)
        sub = probs[sel]
        # Relative to the row's best token, so top-p having left the row unnormalised does not matter.
        _store(probs, sel, sub.masked_fill_(sub < sub.amax(dim=-1, keepdim=True) * scale, 0.0))
    return probs


def _select(positions: list[int], n: int, device: torch.device) -> torch.Tensor | slice | None:
    """Rows to work on: None for none, a slice (a view, no copy) for all, else an index tensor."""
    if not positions:
        return None
    if len(positions) == n:
        return slice(None)
    return _index(positions, device)


def _positions(sel: torch.Tensor | slice, n: int) -> list[int]:
    return list(range(n)) if isinstance(sel, slice) else sel.tolist()


def _store(dest: torch.Tensor, sel: torch.Tensor | slice, sub: torch.Tensor) -> None:
    # A slice selected a view that was updated in place; an index selected a copy that must go back.
    if not isinstance(sel, slice):
        dest[sel] = sub


def _column(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True).unsqueeze(1)


def _uniform(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand((), generator=generator, device=generator.device).to(device, non_blocking=True)


def nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row ([m, vocab] probabilities, [m, 1] top_p), the probability of the least likely token in the
    smallest top set whose mass reaches top_p. Keeping every token at or above it keeps the nucleus, and
    ties with its last token (transformers would keep an arbitrary subset of those ties).

    The answer depends only on the row's values sorted descending, so it is the same whatever the batch,
    the device or the candidate set. Masses are summed in float64: in float32 the running sum over
    thousands of tokens drifts enough to move the cut. On CUDA a full sort is cheap; on the CPU sorting
    49152 values per row costs milliseconds, so only candidates are sorted (see `_candidates`).
    """
    if not probs.is_cuda:
        found = _candidates(probs, top_p)
        if found is not None:
            n_keep, cum = _nucleus_size(found, top_p)
            # Candidates are the top of each row's order: once their mass reaches top_p, every token past
            # them has at least top_p before it, so the nucleus is the same as over the whole row.
            if bool((cum[:, -1:] >= top_p).all()):
                return found.gather(1, n_keep - 1)
    ordered = probs.sort(dim=-1, descending=True).values
    return ordered.gather(1, _nucleus_size(ordered, top_p)[0] - 1)


def _nucleus_size(ordered: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of each row's sorted values are in its nucleus, and the running mass (float64)."""
    cum = ordered.double().cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    # A token is in the nucleus while the mass strictly before it is below top_p; the best one always is,
    # also when top_p is too small to count in float32 (1e-46 reads as 0).
    return (before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1), cum


def _candidates(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """The top of each row that should hold its nucleus, sorted descending and zero-padded to a common
    width; None when that would be most of the vocabulary anyway.

    Two value thresholds, so the candidates are always a prefix of the row's descending order. First,
    tokens at or below (1 - top_p) / vocab together weigh at most 1 - top_p and are never in a nucleus.
    Then a histogram of the survivors over 1/8-octave bins (the float's exponent and 3 mantissa bits: one
    shift) finds the bin where the mass from the top reaches top_p; the candidates are that bin and up, plus
    one spare bin against the histogram's float32 rounding (the caller checks the result anyway).
    """
    m, vocab = probs.shape
    rows, cols = (probs > (1.0 - top_p) / vocab).nonzero(as_tuple=True)
    values = probs[rows, cols]
    # For non-negative floats the bit pattern orders like the value, so the shifted bits are monotone bins.
    bins = (values.view(torch.int32) >> _BIN_SHIFT).long()
    mass = torch.zeros(m * _N_BINS, dtype=probs.dtype).index_add_(0, rows * _N_BINS + bins, values)
    from_top = mass.view(m, _N_BINS).flip(-1).cumsum(dim=-1)
    short = (from_top < top_p).sum(dim=-1)  # bins from the top whose mass is still short of top_p
    keep = bins >= (_N_BINS - 2 - short).clamp_(min=0)[rows]
    rows, values = rows[keep], values[keep]
    sizes = torch.bincount(rows, minlength=m).tolist()
    if max(sizes) > vocab // 2 or min(sizes) == 0:
        return None
    # nonzero() lists row by row, so splitting by the counts gives each row its candidates.
    padded = torch.nn.utils.rnn.pad_sequence(list(torch.split(values, sizes)), batch_first=True)
    return padded.sort(dim=-1, descending=True).values


def _logprobs(logits: torch.Tensor, rows: list[SampleRow], chosen: torch.Tensor) -> list[TokenLogprob | None]:
    wanted = [i for i, row in enumerate(rows) if row.logprobs]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return out
    sel = _select(wanted, len(rows), logits.device)
    logp = torch.log_softmax(logits[sel].float(), dim=-1)
    chosen_ids = chosen[sel]
    chosen_logp = logp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    n_top = max(rows[i].top_logprobs for i in wanted)
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if n_top > 0:
        top = logp.topk(min(n_top, logp.shape[1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    chosen_list = chosen_ids.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].top_logprobs
        out[i] = TokenLogprob(
            token_id=chosen_list[j],
            logprob=chosen_logp[j],
            top=list(zip(top_ids[j][:n], top_values[j][:n], strict=True)),
        )
    return out
