"""Engine settings: one frozen dataclass, built once from flags by the server and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.engine.types.request import MAX_TOP_LOGPROBS


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Sizes and limits of the step loop.

    The KV pool is sized once at start: `kv_cache_tokens` when set, else `kv_cache_memory_fraction`
    of the device's free memory (CUDA) or of `cpu_kv_cache_bytes` (CPU).
    """

    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_cache_memory_fraction: float = 0.6
    cpu_kv_cache_bytes: int = 4 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # While generating sequences run, pooling requests (Embed on a decoder model) take at most this share of a step's
    # tokens (Scheduler.pooling_cap): 0.2 keeps a step that decodes within ~1.25x of its cost alone, so that streams
    # keep ~0.8x of their rate whatever embedding traffic shares the server; 1: pooling takes what the budget leaves.
    pooling_share: float = 0.2
    # A step's fixed cost in tokens' worth of compute (Scheduler.pooling_cap's F): beside G streams pooling takes
    # floor((G + F) * share / (1 - share)) tokens a step. None: measured at start on the engine's own step
    # (core/pooling_cost.py; ~2 on an AVX2 CPU's exact GGUF path, ~60 where a step mostly reads the weights).
    pooling_step_tokens: int | None = None
    max_model_len: int | None = None
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    session_ttl_s: float = 600.0
    max_sessions: int = 4096
    session_pool_fraction: float = 0.8
    cuda_graphs: bool = True
    # The torch and CUDA backends' attention: "triton" (one varlen paged kernel for the whole step), "torch"
    # (gathered decode groups and per-chunk SDPA), or "auto" (triton on CUDA where it is installed).
    attention_kernel: str = "auto"
    # The CUDA backend's mixed steps (prompt chunks beside decodes): "eager", or the candidates "compile" and
    # "compile-graphs" (backends/piecewise.py), left to the GPU's measurement.
    mixed_steps: str = "eager"
    cpu_kernels: str = "auto"  # the CPU backend's compiled kernels: auto (use where installed), require, off
    native_attention: bool = True  # CPU: the compiled decode-attention kernel (backends/cpu/native.py)
    packed_linear: bool = (
        True  # CPU float32 linears through oneDNN, weights packed once (backends/cpu/packed_linear.py)
    )
    # KV tiers below the pool (engine/kv_tiers): bytes of host memory, and a folder with its byte bound on disk.
    kv_offload_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 4 << 30
    fused_layers: bool = True  # CPU Llama-family models through the fused forward (backends/cpu/fused_layers.py)
    # CPU, a GGUF's blocks: a step whose every token the decode kernel attends runs in one C call
    # (backends/cpu/step_program.py), the same kernels in the same order as the fused forward's Python loop.
    compiled_steps: bool = True
    # Constraints (sample/constraints.py): compiled off the step thread within this bound, cached per kind and text.
    constraint_compile_timeout_s: float = 10.0
    constraint_cache_size: int = 256
    max_top_logprobs: int = MAX_TOP_LOGPROBS  # the most alternatives a request may ask for per token
    max_n: int = 16  # the most completions one request may ask for (GenerationRequest.n; why 16: flags.py)
    # LoRA adapters (engine/lora): off unless enabled or an adapter is named at start. `max_loras` adapters can be
    # in one step (device slots), `max_cpu_loras` stay read in memory (None: max(max_loras, len(loras))).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    loras: tuple[tuple[str, str], ...] = ()  # (name, folder) read at start, before the server reports SERVING
    # Speculative decoding without a draft model (engine/spec): "ngram" (prompt lookup), "suffix" (suffix trees
    # over the context and the identity's earlier answers) or "off"; at most `speculative_max_k` drafts per
    # sequence per step, as the load rule chooses from a step-cost table measured at start-up (or read from
    # `speculative_cost_table`, JSON from calibrate.dump).
    speculative: str = "off"
    # 16: at one sequence verifying 15 drafts costs ~1.5x a plain step and 7 ~1.2x (spec-replay --step-cost,
    # benchmarks/README.md), so long guesses pay there; the load rule gives fewer as the batch grows.
    speculative_max_k: int = 16
    speculative_cost_table: str | None = None
    # Overlap (core/steps.py's OverlapRunner): plan and launch step N+1 while step N runs. Off until a GPU measures it;
    # on a CPU the forward holds the cores, so little is to be gained there.
    async_scheduling: bool = False

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.loras)

    @property
    def cpu_loras(self) -> int:
        """The most adapters kept read in memory."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return max(self.max_loras, len(self.loras))
