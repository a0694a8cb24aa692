"""The activation side of the int8 and 4-bit weight kernels (``cpu_quantized.cpp``).

Both kernels quantize each row of activations per group of 32 inputs to int8 so that their
inner loop is an exact integer dot product. This is that quantization in torch, operation for
operation as the kernel does it in float32 (so the references reproduce its integers).
"""

from __future__ import annotations

import torch

__all__ = ["GROUP", "quantize_activations"]

GROUP = 32  # inputs per activation scale (and per q4 weight scale)
TINY_AMAX = 2.0**-90  # a group whose largest |x| is below this quantizes to zero


def quantize_activations(
    x: torch.Tensor,  # [rows, in_features] float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row and group of 32 (the last group zero-padded), ``xq = round(x * (127 / amax))``
    (half to even; 0 where amax < 2^-90) as int8, ``dx = amax / 127`` and ``xs = sum(x)`` over
    the group. Returns ``xq [rows, G, 32]`` int8, ``dx [rows, G]``, ``xs [rows, G]`` (float32)."""
    rows, in_features = x.shape
    groups = -(-in_features // GROUP)
    g = torch.nn.functional.pad(x.float(), (0, groups * GROUP - in_features)).view(rows, groups, GROUP)
    amax = g.abs().amax(-1)
    # One correctly rounded division, as the kernel does: torch's ``127.0 / amax`` is a
    # reciprocal times 127 (two roundings), which moves a code by one near a tie.
    # Groups with amax below 2^-90 quantize to zero (the kernel's VNNI paths rely on it).
    inv = torch.where(amax >= TINY_AMAX, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(g * inv.unsqueeze(-1)).to(torch.int8)
    return xq, amax / 127.0, g.sum(-1)
