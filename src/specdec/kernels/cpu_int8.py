"""Weight-only int8 linear layers for AVX2 CPUs, beside the pure-torch functions they match.

A draft model at batch 1 spends its time reading weights; int8 weights with one float32 scale
per output feature are half the bytes of bf16, and the packed kernel reads them in about 0.6x
the time at one or two rows. Quantizing changes what the draft *proposes*, never what the
generator *emits*: every verifier judges drafts against the target's exact distribution, using
the draft's own (quantized) probabilities.

:func:`quantize_int8` is symmetric per-row quantization; :func:`pack_int8` lays the int8 rows out
in panels of 16 output features, k-major (``[N/16, K, 16]``, natural feature order);
:func:`int8_linear` runs the kernel (built with the bf16 one, see
:mod:`specdec.kernels.cpu_linear`) or :func:`int8_linear_reference`, the specification.
"""

from __future__ import annotations

import torch

from specdec.kernels.cpu_linear import PANEL, load_kernel

__all__ = ["quantize_int8", "pack_int8", "unpack_int8", "int8_linear", "int8_linear_reference"]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float weight -> (``[out, in]`` int8, ``[out]`` float32 scale) with
    ``weight ~= q * scale[:, None]``; each row's largest magnitude maps to 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` int8 + ``[out]`` scale -> ``[ceil(out/16), in, 16]`` int8 panels and the
    scale padded to ``ceil(out/16) * 16`` (padding features are zero)."""
    out_features, in_features = q.shape
    panels = -(-out_features // PANEL)
    padded = q.new_zeros(panels * PANEL, in_features)
    padded[:out_features] = q
    scale_padded = scale.new_zeros(panels * PANEL)
    scale_padded[:out_features] = scale
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous(), scale_padded


def unpack_int8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int8` for the weights: ``[panels, in, 16]`` -> ``[out, in]``."""
    panels, in_features, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, in_features)[:out_features]


def int8_linear_reference(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # [panels, in_features, 16] int8
    scale: torch.Tensor,  # [panels * 16] float32
    out_features: int,
) -> torch.Tensor:  # [rows, out_features] float32
    """The specification: the float32 product with the int8 weights, scaled per feature."""
    q = unpack_int8(packed, out_features).float()
    return (x.float() @ q.T) * scale[:out_features]


def int8_linear(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # [panels, in_features, 16] int8
    scale: torch.Tensor,  # [panels * 16] float32
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features] float32
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [rows, out_features] out_dtype
    """``(x @ (q * scale).T + bias)`` rounded to ``out_dtype``: the kernel, or the reference."""
    kernel = load_kernel()
    if kernel is None or out_dtype not in (torch.float32, torch.bfloat16):
        out = int8_linear_reference(x, packed, scale, out_features)
        return (out if bias is None else out + bias).to(out_dtype)
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    return kernel.packed_int8_linear_layer(
        x.contiguous(), packed, scale, out_features, bias, out_dtype == torch.bfloat16
    )
