"""A linear layer of this package as the C++ callers that run several layers at once hold it
(``kernels/cpu_linear_call.h``: the whole-stack kernels, the sparse MoE block)."""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.packed import PackedLinear
from specdec.models.quantized import Int8Linear, Q4Linear

__all__ = ["kernel_args"]

_PACKED_BF16, _INT8, _Q4 = 0, 1, 2  # the kernel's LinearKind


def kernel_args(linear: nn.Module, bf16_dot: int, vnni: int) -> tuple | None:
    """``(kind, packed, scale, out_features, bias, mode)`` of a linear with a bf16 result, as its
    own forward passes them to the kernel (``bf16_dot``, ``vnni``: the modes it would pass); None
    for any other module. Reads ``_buffers`` directly: this runs for every linear at every forward
    (nn.Module attribute lookups cost ~1 us each, 1.4 ms a step of a 28-layer model)."""
    kind = _KINDS.get(type(linear))
    if kind is None or linear.__dict__["out_dtype"] != torch.bfloat16:
        return None
    buffers = linear._buffers
    mode = bf16_dot if kind == _PACKED_BF16 else vnni
    return kind, buffers["packed"], buffers.get("scale"), linear.__dict__["out_features"], buffers["bias"], mode


_KINDS = {PackedLinear: _PACKED_BF16, Int8Linear: _INT8, Q4Linear: _Q4}
