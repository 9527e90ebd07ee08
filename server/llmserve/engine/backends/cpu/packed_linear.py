"""float32 linear layers on the CPU through oneDNN, with each weight reordered once into its blocked layout.

ATen's default float32 GEMM on the CPU repacks the weight on every call, which costs most at the small row
counts of decode steps. Measured on the 2-core benchmark machine (SmolLM2-135M's seven projections of one
layer, median of 7; /tmp benchmark, see issue 5's note): 32 rows 4.07 -> 3.29 ms, 160 rows 12.3 -> 10.0 ms,
512 rows 36.8 -> 31.3 ms. The price is a second copy of every packed weight.

`pack_linears` swaps the forward of each `nn.Linear` for one that calls the packed weight; the modules and
their parameters stay as they are, so the model is still the model it was (and `generate` on it still
works, through the same packed layers).
"""

from __future__ import annotations

import types

import torch
from torch import nn

_PACKED = "_llmserve_packed_weight"


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build can run packed linears for this device and dtype."""
    ops = torch.ops.mkldnn
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout, tuned for `batch_hint` rows (any row count works)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with a weight from `pack_weight`; x contiguous."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x.contiguous(), getattr(self, _PACKED), self.bias)


@torch.inference_mode()
def pack_linears(model: nn.Module, batch_hint: int = 64) -> int:
    """Route every float32 `nn.Linear` of `model` through a packed copy of its weight; returns how many.

    Idempotent: layers packed before are left alone. `batch_hint` is the row count the layout is tuned for;
    any row count works.
    """
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or hasattr(module, _PACKED) or module.weight.dtype != torch.float32:
            continue
        setattr(module, _PACKED, pack_weight(module.weight.detach(), batch_hint))
        setattr(module, "forward", types.MethodType(_packed_forward, module))  # noqa: B010 - a method, typed
        count += 1
    return count
