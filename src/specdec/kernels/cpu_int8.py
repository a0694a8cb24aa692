"""Weight-only int8 linear layers for AVX2 CPUs, beside the pure-torch functions they match.

Decoding reads every weight once per step; int8 weights with one float32 scale per output
feature are half the bytes of bf16. :func:`quantize_int8` is symmetric per-row quantization;
:func:`pack_int8` lays the int8 rows out for the kernel (``cpu_quantized.cpp``: panels of 8
output features, groups of 32 inputs, 4 consecutive inputs of a feature side by side);
:func:`int8_linear` runs it, or :func:`int8_linear_reference`, the specification.

The kernel quantizes activations per row and group of 32 to int8
(:func:`specdec.kernels.int8_activations.quantize_activations`) so its inner loop is an exact
integer dot product; each row is computed on its own, so a row of a verify pass equals the same
row decoded alone. Quantizing a draft changes what it *proposes*, never what the generator
*emits* (verifiers judge drafts against the target's exact distribution).
"""

from __future__ import annotations

import torch

from specdec.kernels.cpu_linear import kernel_linear, load_kernel, vnni_mode
from specdec.kernels.int8_activations import GROUP, quantize_activations

__all__ = ["quantize_int8", "pack_int8", "unpack_int8", "int8_linear", "int8_linear_reference"]

FEATURES = 8  # output features per packed panel


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float weight -> (``[out, in]`` int8, ``[out]`` float32 scale) with
    ``weight ~= q * scale[:, None]``; each row's largest magnitude maps to 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` int8 + ``[out]`` scale -> ``[ceil(out/8), ceil(in/32), 256]`` int8 panels
    (byte ``32j + 4f + t`` of a panel's group: feature f, input ``4j + t`` of the group) and the
    scale padded to ``ceil(out/8) * 8``. Padding features and inputs are zero."""
    out_features, in_features = q.shape
    panels, groups = -(-out_features // FEATURES), -(-in_features // GROUP)
    padded = q.new_zeros(panels * FEATURES, groups * GROUP)
    padded[:out_features, :in_features] = q
    packed = padded.view(panels, FEATURES, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [P, G, j, f, t]
    scale_padded = scale.new_zeros(panels * FEATURES)
    scale_padded[:out_features] = scale
    return packed.reshape(panels, groups, 256).contiguous(), scale_padded


def unpack_int8(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int8` for the weights: ``[panels, groups, 256]`` -> ``[out, in]``."""
    panels, groups, _ = packed.shape
    q = packed.view(panels, groups, 8, FEATURES, 4).permute(0, 3, 1, 2, 4)  # [P, f, G, j, t]
    return q.reshape(panels * FEATURES, groups * GROUP)[:out_features, :in_features]


def int8_linear_reference(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # [panels, groups, 256] int8
    scale: torch.Tensor,  # [panels * 8] float32
    out_features: int,
) -> torch.Tensor:  # [rows, out_features] float32
    """The specification: exact integer dots of the quantized activations with the int8
    weights, ``sum over groups of dot * dx``, times the feature's scale (accumulated in float64
    here; the kernel's float32 chain agrees to float32 rounding)."""
    rows, in_features = x.shape
    q = unpack_int8(packed, out_features, in_features)
    xq, dx, _ = quantize_activations(x.float())
    groups = xq.shape[1]
    qg = torch.nn.functional.pad(q, (0, groups * GROUP - in_features)).view(out_features, groups, GROUP)
    dots = torch.einsum("rgk,ngk->rng", xq.double(), qg.double())  # exact: |dot| < 2^19
    return ((dots * dx.double().unsqueeze(1)).sum(-1) * scale[:out_features].double()).float()


def int8_linear(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # [panels, groups, 256] int8
    scale: torch.Tensor,  # [panels * 8] float32
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features] float32
    out_dtype: torch.dtype = torch.float32,
    use_vnni: int | None = None,
) -> torch.Tensor:  # [rows, out_features] out_dtype
    """``(x @ (q * scale).T + bias)`` rounded to ``out_dtype``: the kernel or, where it is
    unavailable, the reference. ``use_vnni``: None by the CPU unless ``SPECDEC_DISABLE_AVX512``
    asks for AVX2, -1 by the CPU, 0 AVX2 only, 1 AVX512-VNNI one panel at a time, 2 AVX512-VNNI
    on panel pairs; all give the same bits."""
    mode = vnni_mode() if use_vnni is None else use_vnni
    return kernel_linear(
        load_kernel(), "int8_linear_layer", int8_linear_reference,
        x, (packed, scale), out_features, bias, out_dtype, mode,
    )  # fmt: skip
