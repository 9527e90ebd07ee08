"""The machine's roofline for this workload: measured peaks, the model's work per step, the floor.

Peaks are the best of a few repetitions of a large matmul (FLOP/s) and of a large tensor sum (read bandwidth)
in the benchmark's dtype on its device, measured on the kernels llmserve runs in that dtype: on the CPU ATen's
GEMM and oneDNN's packed one in float32 and bfloat16 (the faster counting: AMX tiles where the CPU has them,
AVX512-BF16 dot products below), oneDNN's u8 x s8 kernel with int32 sums for int8 (integer operations per
second, AMX-INT8 or AVX512-VNNI). So "% of roofline" is held to each dtype's own ceiling, never float32's.

A decode step at batch B and mean context c does 2 * matmul_params * B FLOPs plus
attention (4 * heads * head_dim * c per token per layer), and reads every weight once plus the KV of the B
sequences. Its floor is max(flops / peak_flops, bytes / bandwidth); B over that floor is the most decode
tokens/s the machine can give if steps held nothing but decodes.

In this workload they do not: every request brings hundreds of prompt tokens per 128 generated, and at 32
concurrent the engine's steps carry those prompt chunks too. The workload floor therefore adds each
request's prefill at peak FLOP/s (every layer for each prompt token, causal attention to the tokens before
it, the LM head once: that samples the first new token) to its 127 shares of a decode step for the others.

That floor is for the workload's average prompt. A measurement window serves whatever requests fall in it,
and with log-uniform prompt lengths a few dozen requests can average well above or below the mean. So the
share the engine is held to is taken per window, on the work that window served: `Roofline.work_floor_s`
of the prompts whose first token came in it and of the other tokens generated in it (at their own mean
context), over the window's length.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import PretrainedConfig

from llmserve.engine.backends.cpu import packed_linear


@dataclass(slots=True)
class MachinePeak:
    """Measured peaks on one device and dtype."""

    device: str
    dtype: str
    matmul_flops_per_s: float
    read_bytes_per_s: float
    copy_bytes_per_s: float


@dataclass(slots=True, frozen=True)
class ModelWork:
    """What the model does per token, in FLOPs and bytes, for any mix of prefill and decode."""

    token_flops: float  # every layer's matmuls for one token (the LM head not included)
    head_flops: float  # the LM head for one token
    attention_flops_per_pair: float  # one (query, key) pair over all layers
    weight_bytes: float  # every matmul weight, read once per step
    kv_bytes_per_token: float  # one token's K/V over all layers

    @classmethod
    def of(cls, config: PretrainedConfig, dtype_bytes: float, kv_bytes: int | None = None) -> ModelWork:
        """`dtype_bytes` per weight (int8: 1), `kv_bytes` per cached value (default: the weights')."""
        params = matmul_params(config)
        head = 2.0 * config.hidden_size * config.vocab_size
        return cls(
            token_flops=2.0 * params - head,
            head_flops=head,
            attention_flops_per_pair=attention_flops(config, 1),
            weight_bytes=float(params * dtype_bytes),
            kv_bytes_per_token=float(kv_bytes_per_token(config, kv_bytes or int(dtype_bytes))),
        )

    def prefill_flops(self, new: int, cached: int = 0) -> float:
        """A causal prefill of `new` tokens after `cached` ones: every layer per token, each token attending
        to everything before it and itself, the LM head once (for the token that samples)."""
        pairs = new * cached + new * (new + 1) / 2
        return new * self.token_flops + pairs * self.attention_flops_per_pair + self.head_flops

    def decode_step(self, batch: int, context: float) -> tuple[float, float]:
        """FLOPs and bytes read of one decode step of `batch` sequences at mean context `context`."""
        flops = batch * (self.token_flops + self.head_flops + context * self.attention_flops_per_pair)
        return flops, self.weight_bytes + batch * context * self.kv_bytes_per_token


@dataclass(slots=True)
class Roofline:
    """The floor of one decode step of the workload and the ceilings it implies."""

    peak: MachinePeak
    work: ModelWork
    batch: int
    mean_context: float
    matmul_params: int
    flops_per_step: float
    bytes_per_step: float
    step_floor_s: float
    bound: str
    max_decode_tokens_per_s: float
    prefill_flops_per_request: float
    max_output_tokens_per_s_with_prefill: float  # the workload floor's output tokens/s

    def to_json(self) -> dict:
        return asdict(self)

    def decode_step_s(self, context: float) -> float:
        """The floor of one decode step of `batch` sequences at mean context `context`."""
        return _floor_s(self.peak, *self.work.decode_step(self.batch, context))[0]

    def work_floor_s(self, prefills: Sequence[tuple[int, int]], decode_tokens: int, context: float) -> float:
        """The least time for some served work: prefills as (new, cached) prompt tokens at peak FLOP/s, plus
        `decode_tokens` generated tokens at one batch share of a decode step at mean context `context`."""
        prefill = sum(self.work.prefill_flops(new, cached) for new, cached in prefills)
        return prefill / self.peak.matmul_flops_per_s + decode_tokens * self.decode_step_s(context) / self.batch


def _floor_s(peak: MachinePeak, flops: float, nbytes: float) -> tuple[float, str]:
    """The least time for `flops` and `nbytes` on `peak`, and which of the two bounds it."""
    compute_s, memory_s = flops / peak.matmul_flops_per_s, nbytes / peak.read_bytes_per_s
    return (compute_s, "compute") if compute_s >= memory_s else (memory_s, "memory")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, reps: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


INT8 = "int8"  # the CPU's int8 linears (`--dtype int8`): integer operations per second


@torch.inference_mode()
def measure_peak(device: torch.device, dtype: torch.dtype | str, quick: bool = False) -> MachinePeak:
    """Best-of-N matmul FLOP/s (`dtype` INT8: int8 operations/s) and memory bandwidth; sizes big enough to leave
    the caches behind."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else (1024 if quick else 2048)
    reps = 3 if quick else 5
    mm = _int8_time(n, reps) if dtype == INT8 else _matmul_time(n, device, dtype, reps)
    size = 1 << 30 if cuda else (32 << 20 if quick else 128 << 20)
    x = torch.ones(size // 4, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    read = _best_time(lambda: x.sum(), device, reps)
    copy = _best_time(lambda: y.copy_(x), device, reps)
    return MachinePeak(str(device), str(dtype).removeprefix("torch."), 2 * n**3 / mm, size / read, 2 * size / copy)


def _matmul_time(n: int, device: torch.device, dtype: torch.dtype, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = _best_time(lambda: torch.mm(a, b), device, reps)
    # What llmserve's CPU linears run on (packed_linear): the peak is the faster.
    bf16 = dtype == torch.bfloat16 and device.type == "cpu" and packed_linear.bf16_available()
    if packed_linear.available(device, dtype) or bf16:
        packed = packed_linear.pack_weight(b, n)
        best = min(best, _best_time(lambda: packed_linear.linear(a, packed), device, reps))
    return best


def _int8_time(n: int, reps: int) -> float:
    """oneDNN's u8 x s8 matmul with int32 sums and float32 results, as packed_linear.Int8Linear calls it."""
    x = torch.randint(0, 256, (n, n), dtype=torch.uint8)
    w = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(w, [n, n])
    scales, zeros = torch.ones(n), torch.zeros(n, dtype=torch.long)

    def run() -> torch.Tensor:
        out: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
            x, 1.0, 128, packed, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return out

    return _best_time(run, torch.device("cpu"), reps)


def best_of(a: MachinePeak, b: MachinePeak) -> MachinePeak:
    """The higher of two measurements of each peak: on a shared machine, noise only ever lowers them."""
    return MachinePeak(
        a.device,
        a.dtype,
        max(a.matmul_flops_per_s, b.matmul_flops_per_s),
        max(a.read_bytes_per_s, b.read_bytes_per_s),
        max(a.copy_bytes_per_s, b.copy_bytes_per_s),
    )


def matmul_params(config: PretrainedConfig) -> int:
    """Weights that take part in a matmul per token: attention and MLP projections of every layer, and the
    LM head (the embedding lookup reads one row, so it is not counted separately)."""
    h, i = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * d * 2 + h * kv_heads * d * 2 + 3 * h * i
    return config.num_hidden_layers * per_layer + h * config.vocab_size


def attention_flops(config: PretrainedConfig, context: float) -> float:
    """FLOPs of attention for one token attending to `context` tokens, all layers (QK^T and PV)."""
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 4.0 * heads * d * context * config.num_hidden_layers


def kv_bytes_per_token(config: PretrainedConfig, dtype_bytes: int) -> int:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * kv_heads * d * config.num_hidden_layers * dtype_bytes


def roofline(
    config: PretrainedConfig,
    peak: MachinePeak,
    dtype_bytes: float,
    batch: int,
    prompt_lengths: Sequence[int],
    new_tokens: int,
    kv_bytes: int | None = None,
) -> Roofline:
    """The decode-step floor at `batch` sequences of mean context `mean(prompt_lengths) + new_tokens / 2`;
    `dtype_bytes` per weight, `kv_bytes` per cached value (default: the weights')."""
    config = config.get_text_config()
    work = ModelWork.of(config, dtype_bytes, kv_bytes)
    context = sum(prompt_lengths) / len(prompt_lengths) + new_tokens / 2
    flops, nbytes = work.decode_step(batch, context)
    floor, bound = _floor_s(peak, flops, nbytes)
    prefill = sum(work.prefill_flops(n) for n in prompt_lengths) / len(prompt_lengths)
    # The prefill's last position samples the first new token; each of the others takes a decode step.
    per_request_s = prefill / peak.matmul_flops_per_s + (new_tokens - 1) * floor / batch
    return Roofline(
        peak=peak,
        work=work,
        batch=batch,
        mean_context=context,
        matmul_params=matmul_params(config),
        flops_per_step=flops,
        bytes_per_step=nbytes,
        step_floor_s=floor,
        bound=bound,
        max_decode_tokens_per_s=batch / floor,
        prefill_flops_per_request=prefill,
        max_output_tokens_per_s_with_prefill=new_tokens / per_request_s,
    )
