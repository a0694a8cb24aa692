"""4-bit weight linear layers for AVX2 CPUs, beside the pure-torch functions they match.

Format ("q4"): groups of 32 input features per output feature, ``w ~= d * q + c`` with ``q`` in
0..15 and ``d``, ``c`` in float16 (0.625 bytes a weight, scales included). :func:`quantize_q4`
picks ``d`` and ``c`` per group by a few rounds of least squares from the min/max start (as
llama.cpp's k-quants do, the range that minimises the squared error rather than the one that
covers every outlier); :func:`pack_q4` lays the codes out for the kernel (see ``cpu_quantized.cpp``);
:func:`q4_linear` runs it, or :func:`q4_linear_reference`, the specification.

The kernel quantizes activations per row and group of 32 to int8
(:func:`specdec.kernels.int8_activations.quantize_activations`)
so its inner loop is an exact integer dot product; each row is computed on its own, so a row of
a verify pass equals the same row decoded alone (speculative greedy == plain greedy at q4).
"""

from __future__ import annotations

import torch

from specdec.kernels.cpu_linear import kernel_linear, load_kernel, vnni_mode
from specdec.kernels.int8_activations import GROUP, quantize_activations

__all__ = [
    "GROUP",
    "quantize_q4",
    "dequantize_q4",
    "pack_q4",
    "unpack_q4",
    "q4_linear",
    "q4_linear_reference",
]

FEATURES = 8  # output features per packed panel
BLOCK_BYTES = 160  # one panel x one group: 128 bytes of codes + 8 float16 d + 8 float16 c
_REFINE_ROUNDS = 4


def _groups(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [out, G, 32] float32, zero-padded
    out_features, in_features = weight.shape
    groups = -(-in_features // GROUP)
    w = weight.detach().float()
    if groups * GROUP != in_features:
        w = torch.nn.functional.pad(w, (0, groups * GROUP - in_features))
    return w.view(out_features, groups, GROUP)


def _codes(w: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Nearest codes for float16-rounded ``d``, ``c``: ``[out, G, 32]`` uint8 in 0..15."""
    d32, c32 = d.float().unsqueeze(-1), c.float().unsqueeze(-1)
    safe = torch.where(d32 > 0, d32, torch.ones_like(d32))
    q = torch.round((w - c32) / safe).clamp_(0, 15)
    return torch.where(d32 > 0, q, torch.zeros_like(q)).to(torch.uint8)


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[out, in]`` weight -> (codes ``[out, G, 32]`` uint8 in 0..15, ``d`` ``[out, G]`` float16,
    ``c`` ``[out, G]`` float16) with ``weight ~= d * q + c`` group by group (``G = ceil(in / 32)``;
    the padding columns of the last group are zero weights and do not count in its fit).

    Start from min/max, then alternate: codes for the scales, least-squares ``(d, c)`` for the
    codes (a line fit of ``w`` on ``q``); a group keeps whichever scales gave the smaller error.
    """
    w = _groups(weight)
    in_features = weight.shape[1]
    valid = torch.ones(w.shape[1] * GROUP, dtype=torch.bool)
    valid[in_features:] = False
    valid = valid.view(1, -1, GROUP).expand_as(w)
    lo = torch.where(valid, w, torch.full_like(w, float("inf"))).amin(-1)
    hi = torch.where(valid, w, torch.full_like(w, float("-inf"))).amax(-1)
    d, c = ((hi - lo) / 15).half(), lo.half()
    q = _codes(w, d, c)
    err = _masked_error(w, q, d, c, valid)
    count = valid.sum(-1).float()
    for _ in range(_REFINE_ROUNDS):
        qf = q.float() * valid
        mean_q, mean_w = qf.sum(-1) / count, (w * valid).sum(-1) / count
        var_q = (qf * qf).sum(-1) / count - mean_q**2
        cov = (qf * w * valid).sum(-1) / count - mean_q * mean_w
        slope = torch.where(var_q > 0, cov / var_q.clamp_min(1e-30), (hi - lo) / 15)
        nd = slope.clamp_min(0).half()
        nc = (mean_w - nd.float() * mean_q).half()
        nq = _codes(w, nd, nc)
        nerr = _masked_error(w, nq, nd, nc, valid)
        better = nerr < err
        d, c, err = (
            torch.where(better, nd, d),
            torch.where(better, nc, c),
            torch.where(better, nerr, err),
        )
        q = torch.where(better.unsqueeze(-1), nq, q)
    q = torch.where(valid, q, torch.zeros_like(q))
    return q, d, c


def _masked_error(
    w: torch.Tensor, q: torch.Tensor, d: torch.Tensor, c: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:  # [out, G] float32: squared error over the real (unpadded) inputs
    diff = q.float() * d.float().unsqueeze(-1) + c.float().unsqueeze(-1) - w
    return (diff * diff * valid).sum(-1)


def dequantize_q4(
    q: torch.Tensor, d: torch.Tensor, c: torch.Tensor, in_features: int
) -> torch.Tensor:
    """Codes and scales -> ``[out, in]`` float32 weight (what the kernel multiplies by)."""
    w = q.float() * d.float().unsqueeze(-1) + c.float().unsqueeze(-1)
    return w.reshape(q.shape[0], -1)[:, :in_features]


def pack_q4(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``[out, G, 32]`` codes + ``[out, G]`` float16 scales -> ``[ceil(out/8), G, 160]`` uint8.

    Per panel of 8 features and group: 8 vectors of 16 bytes (vector j: inputs 4j..4j+3 of the
    group; byte ``4f + t`` holds feature f's code in its low nibble and feature f+4's in its
    high nibble), then ``d[8]`` and ``c[8]`` as float16 bytes. Padding features are zero."""
    out_features, groups, _ = q.shape
    panels = -(-out_features // FEATURES)
    pad = panels * FEATURES - out_features
    if pad:
        q = torch.cat([q, q.new_zeros(pad, groups, GROUP)])
        d = torch.cat([d, d.new_zeros(pad, groups)])
        c = torch.cat([c, c.new_zeros(pad, groups)])
    # [P, 8 f, G, 8 j, 4 t] -> [P, G, 8 j, 8 f, 4 t]: the 32 unpacked bytes of vector j
    v = q.view(panels, FEATURES, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(panels, groups, 8, 32)
    codes = (v[..., :16] | (v[..., 16:] << 4)).reshape(panels, groups, 128)
    scales = torch.stack([d, c]).view(2, panels, FEATURES, groups).permute(1, 3, 0, 2).contiguous()
    scales = scales.view(torch.uint8).reshape(panels, groups, 32)  # [P, G, (d[8], c[8]) float16]
    return torch.cat([codes, scales], dim=-1).contiguous()


def unpack_q4(
    packed: torch.Tensor, out_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_q4`: ``(q [out, G, 32], d [out, G], c [out, G])``."""
    panels, groups, _ = packed.shape
    codes = packed[..., :128].reshape(panels, groups, 8, 16)
    v = torch.cat([codes & 0x0F, codes >> 4], dim=-1)  # [P, G, 8 j, 32] = [.., 8 f, 4 t]
    q = v.view(panels, groups, 8, FEATURES, 4).permute(0, 3, 1, 2, 4).reshape(-1, groups, GROUP)
    scales = packed[..., 128:].contiguous().view(torch.float16).view(panels, groups, 2, FEATURES)
    d = scales[:, :, 0].permute(0, 2, 1).reshape(-1, groups)
    c = scales[:, :, 1].permute(0, 2, 1).reshape(-1, groups)
    return q[:out_features], d[:out_features], c[:out_features]


def q4_linear_reference(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # [panels, G, 160] uint8
    out_features: int,
) -> torch.Tensor:  # [rows, out_features] float32
    """The specification: exact integer dots of the quantized activations with the codes, then
    ``sum over groups of dot * d * dx + c * xs`` (accumulated in float64 here; the kernel's
    float32 chain agrees to float32 rounding)."""
    q, d, c = unpack_q4(packed, out_features)
    xq, dx, xs = quantize_activations(x.float())
    dots = torch.einsum("rgk,ngk->rng", xq.double(), q.double())  # exact: |dot| < 2^17
    return (
        (dots * d.double().unsqueeze(0) * dx.double().unsqueeze(1)).sum(-1)
        + xs.double() @ c.double().T
    ).float()


def q4_linear(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # [panels, G, 160] uint8
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features] float32
    out_dtype: torch.dtype = torch.float32,
    use_vnni: int | None = None,
) -> torch.Tensor:  # [rows, out_features] out_dtype
    """``x @ W.T (+ bias)`` over the 4-bit weights: the kernel or, where it is unavailable, the
    reference. ``use_vnni``: None by the CPU unless ``SPECDEC_DISABLE_AVX512`` asks for AVX2, -1
    by the CPU, 0 AVX2 only, 1 AVX512-VNNI one panel at a time, 2 AVX512-VNNI on panel pairs;
    all give the same bits."""
    mode = vnni_mode() if use_vnni is None else use_vnni
    return kernel_linear(
        load_kernel(), "q4_linear_layer", q4_linear_reference,
        x, (packed,), out_features, bias, out_dtype, mode,
    )  # fmt: skip
