"""A whole step of the fused forward over a GGUF's blocks in one C call (csrc/forward.c).

At one sequence a decode step of SmolLM2-135M through FusedForward.run is ~450 kernel calls from Python, and the
calls' dispatch (ctypes, tensor views and allocations, the cache write's index_copy_) cost more than the kernels:
profiled at one thread, the block kernels were 43% of the step and the decode attention's C call 4% of its 17%.
`StepProgram` hands the same kernels, in the same order with the same arguments, to forward.c's `fw_step_run`,
which loops over the layers in C: a row's logits and the cache it writes are bit for bit the Python loop's
(tests/engine/backends/cpu/test_step_program.py), so batch invariance and exactness carry over.

It is built once, beside the fused forward (cpu/backend.py), where every linear is a GGUF's blocks run by the
compiled kernels and the decode kernel serves the model's shape; per step `fits` says whether the step is one it
runs: every token a query of the decode kernel (no prompt chunk for SDPA), no LoRA rows, no pooling.
"""

from __future__ import annotations

import ctypes

import torch

from llmserve.engine.backends.attention import KernelDecodeAttention
from llmserve.engine.backends.cpu import native, quant
from llmserve.engine.backends.cpu.fused_layers import FusedForward
from llmserve.engine.backends.cpu.gguf_linear import BlockLinear

PARTS = 3  # forward.c's FW_PARTS
_P, _L, _I, _D = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double


class _Linear(ctypes.Structure):
    _fields_ = [
        ("parts", _I),
        ("level", _I * PARTS),
        ("type", _I * PARTS),
        ("packed", _P * PARTS),
        ("n", _L * PARTS),
        ("k", _L),
        ("width", _L),
        ("bias", _P),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
        ("input_eps", _D), ("post_eps", _D), ("q_eps", _D), ("k_eps", _D),
        ("scaling", _D),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("k_cache", _P), ("v_cache", _P),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("hidden", _I), ("inter", _I),
        ("cache_slots", _L),
        ("layer", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        ("final_eps", _D),
        ("head", _Linear),
        ("linear", _P),
        ("attend", _P),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _L),
        ("cos", _P), ("sin", _P),
        ("slots", _P),
        ("tables", _P), ("table_stride", _L),
        ("lens", _P),
        ("max_len", _I), ("block_size", _I),
        ("keep", _P), ("kept", _L),
    ]  # fmt: skip


def _linear(linear: object) -> _Linear | None:
    """A BlockLinear as forward.c reads it; None where a part is not a compiled block kernel (a float type's dense
    linear, or the torch fallback) or there are more parts than forward.c takes."""
    if not isinstance(linear, BlockLinear) or len(linear.parts) > PARTS:
        return None
    out = _Linear(parts=len(linear.parts))
    width = 0
    for i, part in enumerate(linear.parts):
        args = part.kernel_args()
        if args is None:
            return None
        out.level[i], out.type[i], out.packed[i], out.n[i], out.k = args
        width += args[3]
    out.width = width
    out.bias = None if linear.bias is None else linear.bias.data_ptr()
    return out


class StepProgram:
    """FusedForward's step as one forward.c call; see the module docstring. Holds the structures forward.c reads
    and the tensors they point into (the fused forward's norms and biases, the KV cache)."""

    def __init__(self, fused: FusedForward, model: _Model, layers: ctypes.Array[_Layer], lib: ctypes.CDLL) -> None:
        self.fused = fused
        self._model = model
        self._layers = layers  # kept alive: model.layer points into it
        self._run = lib.fw_step_run
        self._run.restype = _I
        self._run.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), _P, _P, _P, _I]
        scratch = lib.fw_scratch_floats
        scratch.restype = _L
        scratch.argtypes = [ctypes.POINTER(_Model), _L]
        self._scratch_floats = scratch
        self.vocab = 0 if fused.lm_head is None else _linear(fused.lm_head).width  # type: ignore[union-attr]

    @classmethod
    def build(cls, fused: FusedForward, kv: torch.Tensor, kernel: native.PagedDecode | None) -> StepProgram | None:
        """The program for `fused` over the cache `kv` [layers, 2, kv heads, slots, dim] attended by `kernel`; None
        where it does not apply (not a GGUF's blocks, a linear it cannot run, no decode kernel, no LM head)."""
        lib = native.library("_fused_ops")
        qlib = quant.library()
        if (
            lib is None
            or qlib is None
            or kernel is None
            or fused.lm_head is None
            or not fused.precision.linears.startswith("gguf")
            or kv.dtype != torch.float32
            or not kv.is_contiguous()
        ):
            return None
        head = _linear(fused.lm_head)
        layers = (_Layer * len(fused.layers))()
        for i, ly in enumerate(fused.layers):
            linears = [_linear(x) for x in (ly.qkv, ly.o, ly.gate_up, ly.down)]
            if head is None or any(x is None for x in linears):
                return None
            layers[i].qkv, layers[i].o, layers[i].gate_up, layers[i].down = linears
            layers[i].input_norm, layers[i].input_eps = ly.input_norm[0].data_ptr(), ly.input_norm[1]
            layers[i].post_norm, layers[i].post_eps = ly.post_norm[0].data_ptr(), ly.post_norm[1]
            if ly.q_norm is not None:
                layers[i].q_norm, layers[i].q_eps = ly.q_norm[0].data_ptr(), ly.q_norm[1]
            if ly.k_norm is not None:
                layers[i].k_norm, layers[i].k_eps = ly.k_norm[0].data_ptr(), ly.k_norm[1]
            layers[i].scaling = ly.scaling
            layers[i].k_cache, layers[i].v_cache = kv[i, 0].data_ptr(), kv[i, 1].data_ptr()
        first = fused.layers[0]
        model = _Model(
            layers=len(fused.layers),
            heads=fused.num_heads,
            kv_heads=fused.num_kv_heads,
            head_dim=fused.head_dim,
            hidden=first.input_norm[0].shape[0],
            inter=layers[0].down.k,
            cache_slots=kv.shape[3],
            layer=ctypes.cast(layers, ctypes.POINTER(_Layer)),
            final_norm=fused.final_norm[0].data_ptr(),
            final_eps=fused.final_norm[1],
            head=head,
            linear=ctypes.cast(quant.kernel_function(fused.activations), _P).value,
            attend=ctypes.cast(kernel.function(torch.float32), _P).value,
        )
        return cls(fused, model, layers, lib)

    @staticmethod
    def fits(batch: object, lora: object, tokens: int) -> bool:
        """Whether a step is one the program runs: every token a query of the decode kernel, no LoRA rows."""
        return lora is None and isinstance(batch, KernelDecodeAttention) and batch.num == tokens and not batch.chunks

    def run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | None, batch: object
    ) -> torch.Tensor:
        """What FusedForward.run returns for a step that `fits` (its logits), bit for bit."""
        assert isinstance(batch, KernelDecodeAttention)
        residual, cos, sin = self.fused.inputs(input_ids, position_ids)
        tokens = input_ids.shape[1]
        slots = batch.slot_mapping.to(torch.long).contiguous()
        kept = tokens if keep is None else keep.numel()
        keep_rows = None if keep is None else keep.to(torch.long).contiguous()
        tables, lens = batch.tables, batch.lens
        step = _Step(
            tokens=tokens,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            slots=slots.data_ptr(),
            tables=tables.data_ptr(),
            table_stride=tables.stride(0) if tables.dim() == 2 else 0,
            lens=lens.data_ptr(),
            max_len=batch.max_len,
            block_size=batch.block_size,
            keep=None if keep_rows is None else keep_rows.data_ptr(),
            kept=kept,
        )
        logits = torch.empty(kept, self.vocab, dtype=torch.float32)
        scratch = torch.empty(self._scratch_floats(ctypes.byref(self._model), tokens), dtype=torch.float32)
        failed = self._run(
            ctypes.byref(self._model),
            ctypes.byref(step),
            residual.data_ptr(),
            logits.data_ptr(),
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise RuntimeError(f"the compiled step failed (kernel code {failed})")
        return logits
