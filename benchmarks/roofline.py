"""The machine's roofline for this workload: measured peaks, the model's work per step, the floor.

Peaks are the best of a few repetitions of a large matmul (FLOP/s; on the CPU in float32 both ATen's GEMM
and oneDNN's packed one, the faster counting) and of a large tensor sum (read bandwidth) in the benchmark's
dtype on its device. A decode step at batch B and mean context c does 2 * matmul_params * B FLOPs plus
attention (4 * heads * head_dim * c per token per layer), and reads every weight once plus the KV of the B
sequences. Its floor is max(flops / peak_flops, bytes / bandwidth); B over that floor is the most decode
tokens/s the machine can give if steps held nothing but decodes.

In this workload they do not: every request brings hundreds of prompt tokens per 128 generated, and at 32
concurrent the engine's steps carry those prompt chunks too. The workload floor therefore adds each
request's prefill at peak FLOP/s (every layer for each prompt token, attention to half the prompt on
average, the LM head once) to its 128 shares of a decode step; that is the roofline the engine is held to.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import PretrainedConfig

from llmserve.engine import packed_linear


@dataclass(slots=True)
class MachinePeak:
    """Measured peaks on one device and dtype."""

    device: str
    dtype: str
    matmul_flops_per_s: float
    read_bytes_per_s: float
    copy_bytes_per_s: float


@dataclass(slots=True)
class Roofline:
    """The floor of one decode step of the workload and the ceilings it implies."""

    peak: MachinePeak
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


@torch.inference_mode()
def measure_peak(device: torch.device, dtype: torch.dtype, quick: bool = False) -> MachinePeak:
    """Best-of-N matmul FLOP/s and memory bandwidth; sizes big enough to leave the caches behind."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else (1024 if quick else 2048)
    reps = 3 if quick else 5
    mm = _matmul_time(n, device, dtype, reps)
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
    if packed_linear.available(device, dtype):  # what llmserve's CPU linears run on: the peak is the faster
        packed = packed_linear.pack_weight(b, n)
        best = min(best, _best_time(lambda: packed_linear.linear(a, packed), device, reps))
    return best


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
    dtype_bytes: int,
    batch: int,
    prompt_lengths: Sequence[int],
    new_tokens: int,
) -> Roofline:
    """The decode-step floor at `batch` sequences of mean context `mean(prompt_lengths) + new_tokens / 2`."""
    config = config.get_text_config()
    mean_prompt = sum(prompt_lengths) / len(prompt_lengths)
    params = matmul_params(config)
    context = mean_prompt + new_tokens / 2
    flops = batch * (2.0 * params + attention_flops(config, context))
    nbytes = params * dtype_bytes + batch * context * kv_bytes_per_token(config, dtype_bytes)
    compute_s, memory_s = flops / peak.matmul_flops_per_s, nbytes / peak.read_bytes_per_s
    floor = max(compute_s, memory_s)
    # Causal prefill of L tokens: every layer for each, attention to L/2 tokens on average, and the LM head
    # only for the last one (the one that samples).
    head = 2.0 * config.hidden_size * config.vocab_size
    per_token = 2.0 * params - head
    prefill = sum(n * (per_token + attention_flops(config, n / 2)) + head for n in prompt_lengths)
    prefill /= len(prompt_lengths)
    per_request_s = prefill / peak.matmul_flops_per_s + new_tokens * floor / batch
    return Roofline(
        peak=peak,
        batch=batch,
        mean_context=context,
        matmul_params=params,
        flops_per_step=flops,
        bytes_per_step=nbytes,
        step_floor_s=floor,
        bound="compute" if compute_s >= memory_s else "memory",
        max_decode_tokens_per_s=batch / floor,
        prefill_flops_per_request=prefill,
        max_output_tokens_per_s_with_prefill=new_tokens / per_request_s,
    )
