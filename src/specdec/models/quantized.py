"""Swap a model's linear layers for weight-only int8 ones (for draft models; see
:mod:`specdec.kernels.cpu_int8` for why that never changes a generator's output)."""

from __future__ import annotations

import torch
from torch import nn

from specdec.kernels.cpu_int8 import int8_linear, pack_int8, quantize_int8, unpack_int8
from specdec.models.packed import PackedLinear, linear_weights

__all__ = ["Int8Linear", "quantize_linears", "WEIGHT_FORMATS"]

WEIGHT_FORMATS = ("bfloat16", "int8")  # what a draft model's linear layers may be stored as


class Int8Linear(nn.Module):
    """A linear layer over int8 weights with per-output-feature float32 scales.

    ``out_dtype``: the model's dtype for hidden layers, float32 for the LM head."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        packed, scale = pack_int8(*quantize_int8(weight))
        self.register_buffer("packed", packed)  # [panels, in, 16] int8
        self.register_buffer("scale", scale)  # [panels * 16] float32
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        out = int8_linear(
            x.reshape(-1, self.in_features), self.packed, self.scale, self.out_features,
            self.bias, self.out_dtype,
        )  # fmt: skip
        return out.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        return unpack_int8(self.packed, self.out_features).float() * self.scale[: self.out_features, None]


def quantize_linears(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` and :class:`PackedLinear` (LM head included) by an
    :class:`Int8Linear`, in place; the input embedding is left as it is (one row is read)."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, (nn.Linear, PackedLinear)):
                weight, bias = linear_weights(child)
                is_head = f"{name}.{child_name}".lstrip(".") == "lm_head"
                dtype = weight.dtype if isinstance(child, nn.Linear) else child.out_dtype
                out_dtype = torch.float32 if is_head else dtype
                setattr(module, child_name, Int8Linear(weight, bias, out_dtype))
    return model
