"""Swap a model's bf16 ``nn.Linear`` layers for packed-weight layers on AVX2 CPUs.

See :mod:`specdec.kernels.cpu_linear` for why: same bytes in a panel order, a kernel whose cost
barely grows from 1 to 6 rows, and row results that do not depend on how many rows share the
call (so a verify pass computes exactly what single-token decoding computes).
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.kernels.cpu_linear import kernel_available, pack_weight, packed_linear, unpack_weight

__all__ = ["PackedLinear", "linear_weights", "pack_linears", "should_pack"]


class PackedLinear(nn.Module):
    """``nn.Linear`` over panel-packed bf16 weights (float32 accumulation).

    ``out_dtype`` is the dtype of the result: the model dtype for hidden layers (bf16, as an
    ordinary bf16 ``nn.Linear`` rounds), float32 for the LM head (logits keep full precision).
    """

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.out_dtype = out_dtype
        self.register_buffer("packed", pack_weight(linear.weight.detach()))
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        out = packed_linear(
            x.reshape(-1, self.in_features), self.packed, self.out_features, self.bias, self.out_dtype
        )
        return out.view(*lead, self.out_features)


def should_pack(model: nn.Module) -> bool:
    """Packing pays for bf16 weights on a CPU where the kernel builds."""
    weight = next(model.parameters())
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and kernel_available()


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every bf16 ``nn.Linear`` (LM head included) by a :class:`PackedLinear`, in place."""
    for name, module in parent_modules(model):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                is_head = f"{name}.{child_name}".lstrip(".") == "lm_head"
                out_dtype = torch.float32 if is_head else child.weight.dtype
                setattr(module, child_name, PackedLinear(child, out_dtype))
    return model


def parent_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` without the linear layers themselves, for loops that replace
    them: a list holding the old layers would keep every replaced weight alive to its end (the
    whole model twice in memory while packing or quantizing)."""
    leaves = (nn.Linear, PackedLinear)
    return [(name, m) for name, m in model.named_modules() if not isinstance(m, leaves)]


def linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias [out] or None)`` of an ``nn.Linear``, a :class:`PackedLinear`
    (unpacked: a copy) or a quantized linear (dequantized, in the dtype of the weight it was
    made from), for code that needs the plain matrix (head training, initialisation)."""
    if hasattr(module, "dequantized"):  # specdec.models.quantized (which imports this module)
        return module.dequantized().to(module.weight_dtype), module.bias
    if isinstance(module, PackedLinear):
        return unpack_weight(module.packed, module.out_features), module.bias
    if isinstance(module, nn.Linear):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    raise TypeError(f"expected nn.Linear, PackedLinear or a quantized linear, got {type(module).__name__}")
