"""Weight-only int8 layers: the kernel against its reference, rows independent of the row
count, quantization within its error bound, and an int8 draft that leaves output unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from specdec.kernels.cpu_int8 import (
    int8_linear,
    int8_linear_reference,
    pack_int8,
    quantize_int8,
    unpack_int8,
)
from specdec.kernels.cpu_linear import load_kernel
from specdec.kernels.int8_activations import quantize_activations
from specdec.models.quantized import Int8Linear, quantize_linears

needs_kernel = pytest.mark.usefixtures("kernel")


def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g)


def test_quantization_error_is_at_most_half_a_step():
    w = _weight(37, 50, 0)
    w[3] = 0.0  # an all-zero row stays exactly zero
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert bool((q[3] == 0).all())


def test_activation_codes_use_one_rounded_division():
    """The reference quantizes activations with the kernel's float32 arithmetic: one correctly
    rounded ``127 / amax``, one product, rounded half to even (numpy as the independent check;
    torch's ``127.0 / tensor`` rounds twice and moves codes near ties)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(400, 96, generator=g) * torch.rand(400, 1, generator=g)).to(torch.bfloat16).float()
    xq, dx, xs = quantize_activations(x)
    groups = x.view(400, 3, 32).numpy()
    amax = np.abs(groups).max(-1, keepdims=True)
    inv = np.float32(127.0) / amax  # float32 / float32: one rounding
    assert inv.dtype == np.float32
    assert np.array_equal(xq.numpy(), np.rint(groups * inv).astype(np.int8))
    assert np.array_equal(dx.numpy(), (amax / np.float32(127.0))[..., 0])


@pytest.mark.parametrize("shape", [(16, 8), (37, 24), (5, 3), (8, 96)])
def test_pack_roundtrip(shape):
    q, scale = quantize_int8(_weight(*shape, 1))
    packed, padded = pack_int8(q, scale)
    assert packed.shape == (-(-shape[0] // 8), -(-shape[1] // 32), 256) and padded.numel() == packed.shape[0] * 8
    assert torch.equal(unpack_int8(packed, *shape), q)


def test_pack_layout_puts_four_inputs_of_a_feature_side_by_side():
    q = torch.arange(8 * 32, dtype=torch.int32).view(8, 32).remainder(127).to(torch.int8)
    packed, _ = pack_int8(q, torch.ones(8))
    # byte 32j + 4f + t of the (only) panel and group: feature f, input 4j + t
    for j, f, t in [(0, 0, 0), (0, 1, 2), (3, 5, 1), (7, 7, 3)]:
        assert int(packed[0, 0, 32 * j + 4 * f + t]) == int(q[f, 4 * j + t])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("out_features", [8, 37, 100])
def test_kernel_matches_reference(rows, out_features):
    g = torch.Generator().manual_seed(rows * 100 + out_features)
    packed, scale = pack_int8(*quantize_int8(_weight(out_features, 72, rows)))
    x = torch.randn(rows, 72, generator=g)
    want = int8_linear_reference(x, packed, scale, out_features)
    got = int8_linear(x, packed, scale, out_features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@needs_kernel
def test_result_is_close_to_the_dense_product():
    w, x = _weight(64, 512, 5), torch.randn(3, 512)
    got = int8_linear(x, *pack_int8(*quantize_int8(w)), 64)
    dense = x @ w.T
    assert float((got - dense).norm() / dense.norm()) < 0.02


@needs_kernel
@pytest.mark.parametrize("out_features", [70, 62])  # 9 panels (a single one left), 8 (a partial pair)
def test_rows_are_batch_invariant_and_instruction_set_invariant(out_features):
    """Bitwise: a row's result does not depend on how many rows share the call, nor on
    whether the AVX2 sequence, VNNI on one panel or VNNI on two panels (unsigned weights,
    the activation sums taken off) computes the integer sums. Extreme codes included."""
    q, scale = quantize_int8(_weight(out_features, 96, 2))
    q[0, :] = -127  # q + 128 = 1 .. 255 at both ends of the unsigned range
    q[1, :] = 127
    packed, scale = pack_int8(q, scale)
    # bf16 inputs put many products near a rounding tie: seed 2 caught a reference that
    # rounded its scale twice (see test_activation_codes_use_one_rounded_division).
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[3, :32] = -1.0  # activations quantized to -127 (a group of equal values)
    together = int8_linear(x, packed, scale, out_features, out_dtype=torch.bfloat16, use_vnni=0)
    for i in range(11):
        alone = int8_linear(x[i : i + 1], packed, scale, out_features, out_dtype=torch.bfloat16, use_vnni=0)
        assert torch.equal(alone, together[i : i + 1])
    ref = int8_linear_reference(x, packed, scale, out_features)
    torch.testing.assert_close(together.float(), ref, rtol=1e-2, atol=1e-2)  # bf16 rounding
    if load_kernel().quantized_has_vnni():
        for mode in (1, 2, -1):
            got = int8_linear(x, packed, scale, out_features, out_dtype=torch.bfloat16, use_vnni=mode)
            assert torch.equal(got, together), mode
            for i in (0, 3, 10):
                alone = int8_linear(x[i : i + 1], packed, scale, out_features, out_dtype=torch.bfloat16, use_vnni=mode)
                assert torch.equal(alone, together[i : i + 1]), mode
    else:
        for mode in (1, 2):
            with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
                int8_linear(x, packed, scale, out_features, use_vnni=mode)


@needs_kernel
def test_negative_control_a_per_call_scale_breaks_batch_invariance():
    """The invariance test above would catch a kernel whose arithmetic depends on the call's
    rows: rounding activations to a scale shared by the rows of a call (as dynamic activation
    quantization does) changes a row's result when other rows join."""
    packed, scale = pack_int8(*quantize_int8(_weight(70, 96, 2)))
    x = torch.randn(11, 96)

    def shared_scale_linear(rows: torch.Tensor) -> torch.Tensor:
        step = rows.abs().max() / 127
        return int8_linear(torch.round(rows / step) * step, packed, scale, 70)

    together = shared_scale_linear(x)
    assert any(not torch.equal(shared_scale_linear(x[i : i + 1]), together[i : i + 1]) for i in range(11))


def test_quantize_linears_replaces_every_linear_and_keeps_outputs_close():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 32, bias=False))
    x = torch.randn(5, 64)
    want = model(x)
    quantize_linears(model)
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], Int8Linear)
    got = model(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)
    assert model[0].dequantized().shape == (128, 64)


@needs_kernel
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_call_rounds_like_the_torch_ops(with_bias):
    """bf16 activations, bias and bf16 rounding handled inside the one call: bitwise what
    widening x to float32, the float32 product, ``+ bias`` and ``.to(bfloat16)`` give."""
    out_features = 70
    packed, scale = pack_int8(*quantize_int8(_weight(out_features, 200, 4)))
    bias = torch.randn(out_features) * 3 if with_bias else None
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    product = int8_linear(x.float(), packed, scale, out_features)  # float32 in, float32 out
    want32 = product if bias is None else product + bias
    assert torch.equal(int8_linear(x, packed, scale, out_features, bias), want32)
    assert torch.equal(int8_linear(x, packed, scale, out_features, bias, torch.bfloat16), want32.to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_sized_calls_split_over_threads_keep_each_rows_bits(threads):
    """As for the 4-bit kernel: more than 16 rows, split over threads, row by row bitwise."""
    packed, scale = pack_int8(*quantize_int8(_weight(70, 200, 4)))
    x = torch.randn(45, 200, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = int8_linear(x, packed, scale, 70, out_dtype=torch.bfloat16)
        alone = [int8_linear(x[i : i + 1], packed, scale, 70, out_dtype=torch.bfloat16) for i in range(45)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(torch.cat(alone), together)
