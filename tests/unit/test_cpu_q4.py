"""4-bit weight layers: the format round-trips, the quantizer fits each group at least as well
as min/max, the kernel matches its reference, rows do not depend on the row count or on the
instruction set, and a broken layout is caught."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.kernels.cpu_linear import load_kernel
from specdec.kernels.cpu_q4 import (
    GROUP,
    dequantize_q4,
    pack_q4,
    q4_linear,
    q4_linear_reference,
    quantize_q4,
    unpack_q4,
)
from specdec.kernels.int8_activations import quantize_activations
from specdec.models.packed import linear_weights
from specdec.models.quantized import Q4Linear, quantize_linears

needs_kernel = pytest.mark.usefixtures("kernel")


def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g)
    w[:, :3] *= 8  # a few outlier columns, as real checkpoints have
    return w


@pytest.mark.parametrize("shape", [(8, 32), (13, 50), (40, 172), (3, 7)])
def test_pack_roundtrip(shape):
    q, d, c = quantize_q4(_weight(*shape, 1))
    groups = -(-shape[1] // GROUP)
    assert q.shape == (shape[0], groups, GROUP) and q.dtype == torch.uint8 and int(q.max()) <= 15
    assert d.shape == c.shape == (shape[0], groups) and d.dtype == c.dtype == torch.float16
    packed = pack_q4(q, d, c)
    assert packed.shape == (-(-shape[0] // 8), groups, 160) and packed.dtype == torch.uint8
    q2, d2, c2 = unpack_q4(packed, shape[0])
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(c2, c)


def test_weights_on_a_4bit_grid_are_recovered_exactly():
    """Each group's w = d * q + c with float16 d, c and codes spanning 0..15: nothing is lost
    (the case of a GGUF Q4_K checkpoint dequantized to bf16 and quantized again)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (24, 4, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(24, 4, generator=g) * 0.01 + 0.001).half()
    c = (torch.randn(24, 4, generator=g) * 0.05).half()
    w = dequantize_q4(q, d, c, 4 * GROUP)
    q2, d2, c2 = quantize_q4(w)
    assert torch.equal(dequantize_q4(q2, d2, c2, 4 * GROUP), w)


def test_least_squares_scales_are_never_worse_than_min_max():
    w = _weight(64, 256, 2)
    q, d, c = quantize_q4(w)
    groups = w.view(64, -1, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    dm, cm = ((hi - lo) / 15).half(), lo.half()
    qm = torch.round((groups - cm.float()[..., None]) / dm.float()[..., None]).clamp(0, 15)
    err_minmax = ((qm * dm.float()[..., None] + cm.float()[..., None] - groups) ** 2).sum(-1)
    err = ((dequantize_q4(q, d, c, 256).view_as(groups) - groups) ** 2).sum(-1)
    assert bool((err <= err_minmax * (1 + 1e-6)).all())
    assert float(err.sum()) < 0.9 * float(err_minmax.sum())  # and clearly better overall


def test_padded_inputs_do_not_count_in_the_fit():
    w = _weight(8, 40, 4)  # the second group has 8 real inputs and 24 padding
    q, d, c = quantize_q4(w)
    assert bool((q[:, 1, 8:] == 0).all())
    err = (dequantize_q4(q, d, c, 40) - w).abs()
    assert float(err[:, 32:].max()) <= float((d[:, 1].float() / 2 + 1e-3).max())


def test_activation_quantization_is_per_row_and_group():
    x = torch.tensor([[1.0] * 31 + [-127.0 * 2] + [0.5] * 8])  # 40 inputs: two groups
    xq, dx, xs = quantize_activations(x)
    assert xq.shape == (1, 2, GROUP) and xq.dtype == torch.int8
    assert dx[0, 0] == pytest.approx(254 / 127) and int(xq[0, 0, 31]) == -127 and int(xq[0, 0, 0]) == 0
    assert int(xq[0, 1, 0]) == 127 and bool((xq[0, 1, 8:] == 0).all())  # padding quantizes to 0
    assert xs[0, 0] == pytest.approx(31 - 254) and xs[0, 1] == pytest.approx(4.0)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(8, 64), (37, 100), (100, 172)])
def test_kernel_matches_reference(rows, shape):
    g = torch.Generator().manual_seed(rows * 1000 + shape[0])
    packed = pack_q4(*quantize_q4(_weight(*shape, rows)))
    x = torch.randn(rows, shape[1], generator=g)
    want = q4_linear_reference(x, packed, shape[0])
    got = q4_linear(x, packed, shape[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@needs_kernel
def test_result_is_close_to_the_dense_product():
    w, x = _weight(64, 512, 5), torch.randn(3, 512)
    got = q4_linear(x, pack_q4(*quantize_q4(w)), 64)
    dense = x @ w.T
    assert float((got - dense).norm() / dense.norm()) < 0.15


@needs_kernel
@pytest.mark.parametrize("out_features", [70, 62])  # 9 panels (a single one left), 8 (a partial pair)
def test_rows_are_batch_invariant_and_instruction_set_invariant(out_features):
    """Bitwise: a row's result does not depend on how many rows share the call, nor on
    whether the CPU's VNNI dot product (one panel or two panels at a time) or the AVX2
    sequence computes the integer sums."""
    packed = pack_q4(*quantize_q4(_weight(out_features, 96, 2)))
    bias = torch.randn(out_features)
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    together = q4_linear(x, packed, out_features, bias, out_dtype=torch.bfloat16, use_vnni=0)
    for i in range(11):
        alone = q4_linear(x[i : i + 1], packed, out_features, bias, out_dtype=torch.bfloat16, use_vnni=0)
        assert torch.equal(alone, together[i : i + 1])
    if load_kernel().quantized_has_vnni():
        for mode in (1, 2, -1):
            got = q4_linear(x, packed, out_features, bias, out_dtype=torch.bfloat16, use_vnni=mode)
            assert torch.equal(got, together), mode
            for i in (0, 5, 10):
                alone = q4_linear(x[i : i + 1], packed, out_features, bias, out_dtype=torch.bfloat16, use_vnni=mode)
                assert torch.equal(alone, together[i : i + 1]), mode
    else:
        for mode in (1, 2):
            with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
                q4_linear(x, packed, out_features, use_vnni=mode)


@needs_kernel
def test_tiny_scales_keep_rows_instruction_set_invariant():
    """The VNNI paths take features 4..7 as 16 x their dot times d / 16, exact only while
    fl(d * dx) / 16 is a normal float32: with float16-subnormal weight scales and activation
    groups near 2^-97 it would not be, so such groups quantize to zero (amax < 2^-90) and every
    path agrees bitwise, in float32, with groups just above the limit (2^-85) computed."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(8)) * 1e-7
    packed = pack_q4(*quantize_q4(w))
    _, d, _ = unpack_q4(packed, 24)
    assert bool((d.float().abs() < 6.1e-5).any()) and bool((d != 0).any())  # float16 subnormal scales
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    x[0] *= 2.0**-97  # flushed: amax < 2^-90
    x[1] *= 2.0**-87  # kept
    xq, _, _ = quantize_activations(x)
    assert bool((xq[0] == 0).all()) and bool((xq[1] != 0).any())
    want = q4_linear(x, packed, 24, use_vnni=0)
    assert bool((want[1] != 0).any())
    if load_kernel().quantized_has_vnni():
        for mode in (1, 2, -1):
            assert torch.equal(q4_linear(x, packed, 24, use_vnni=mode), want), mode


@needs_kernel
def test_negative_control_swapped_nibbles_fail_the_reference_check():
    """The parity test above would catch a layout bug: the kernel reading features 0..3 from
    the high nibbles (and 4..7 from the low ones) gives another product."""
    packed = pack_q4(*quantize_q4(_weight(16, 64, 6)))
    swapped = packed.clone()
    swapped[..., :128] = (packed[..., :128] >> 4) | (packed[..., :128] << 4)
    x = torch.randn(2, 64)
    want = q4_linear_reference(x, packed, 16)
    assert not torch.allclose(q4_linear(x, swapped, 16), want, rtol=1e-3, atol=1e-3)


@needs_kernel
def test_kernel_rejects_mismatched_shapes():
    packed = pack_q4(*quantize_q4(_weight(16, 64, 7)))
    with pytest.raises(RuntimeError, match="in_features"):
        q4_linear(torch.randn(1, 96), packed, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        q4_linear(torch.randn(1, 64), packed, 30)


def test_quantize_linears_q4_replaces_every_linear_and_keeps_outputs_close():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 32, bias=False))
    x = torch.randn(5, 64)
    model.requires_grad_(False)
    want = model(x)
    quantize_linears(model, "q4")
    assert isinstance(model[0], Q4Linear) and isinstance(model[2], Q4Linear)
    got = model(x)
    assert got.dtype == want.dtype
    assert float((got - want).norm() / want.norm()) < 0.1
    weight, bias = linear_weights(model[0])
    assert weight.shape == (128, 64) and weight.dtype == torch.float32 and bias.shape == (128,)


def test_quantize_linears_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'q4', got 'q3'"):
        quantize_linears(nn.Sequential(nn.Linear(4, 4)), "q3")


@needs_kernel
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_call_rounds_like_the_torch_ops(with_bias):
    """bf16 activations, bias and bf16 rounding handled inside the one call: bitwise what
    widening x to float32, the float32 product, ``+ bias`` and ``.to(bfloat16)`` give."""
    out_features = 70
    packed = pack_q4(*quantize_q4(_weight(out_features, 200, 4)))
    bias = torch.randn(out_features) * 3 if with_bias else None
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    product = q4_linear(x.float(), packed, out_features)  # float32 in, float32 out
    want32 = product if bias is None else product + bias
    assert torch.equal(q4_linear(x, packed, out_features, bias), want32)
    assert torch.equal(q4_linear(x, packed, out_features, bias, torch.bfloat16), want32.to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_sized_calls_split_over_threads_keep_each_rows_bits(threads):
    """Calls of more than 16 rows quantize their activations and round their results row
    blocks per thread: each row still equals that row computed alone, at any thread count."""
    packed = pack_q4(*quantize_q4(_weight(70, 200, 4)))
    bias = torch.randn(70)
    x = torch.randn(45, 200, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = q4_linear(x, packed, 70, bias, out_dtype=torch.bfloat16)
        alone = [q4_linear(x[i : i + 1], packed, 70, bias, out_dtype=torch.bfloat16) for i in range(45)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(torch.cat(alone), together)
