"""Grouped int8 / q4 passes (a MoE layer's active experts in one call): each weight's row is
bit for bit what its own call gives, whatever the weights' shape, biases, thread count or
instruction set, and bad arguments are refused before any work."""

from __future__ import annotations

import pytest
import torch

from specdec.kernels.cpu_int8 import pack_int8, quantize_int8
from specdec.kernels.cpu_linear import load_kernel
from specdec.kernels.cpu_q4 import pack_q4, quantize_q4

needs_kernel = pytest.mark.usefixtures("kernel")


def _weights(fmt: str, count: int, out_features: int, in_features: int, seed: int) -> list:
    """``count`` packed weights: q4 tensors, or int8 ``(packed, scale)`` pairs."""
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(out_features, in_features, generator=g) for _ in range(count)]
    return [pack_q4(*quantize_q4(w)) if fmt == "q4" else pack_int8(*quantize_int8(w)) for w in dense]


def _one(ops, fmt, x, w, n, bias, mode):  # the single-weight call the grouped pass must equal
    if fmt == "q4":
        return ops.q4_linear_layer(x, w, n, bias, True, mode)
    return ops.int8_linear_layer(x, w[0], w[1], n, bias, True, mode)


def _grouped(ops, fmt, x, ws, n, biases, mode):
    if fmt == "q4":
        return ops.q4_grouped_linear(x, ws, n, biases, mode)
    return ops.int8_grouped_linear(x, [w[0] for w in ws], [w[1] for w in ws], n, biases, mode)


def _modes(ops) -> list[int]:
    return [0, 1, 2, -1] if ops.quantized_has_vnni() else [0, -1]


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "int8"])
@pytest.mark.parametrize("shape", [(70, 96), (62, 50), (16, 2048)])  # a lone panel, a partial pair, long rows
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_its_own_call_bit_for_bit(fmt, shape, threads):
    n, k = shape
    ops = load_kernel()
    ws = _weights(fmt, 5, n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    biases = [None, torch.randn(n, generator=g), None, None, torch.randn(n, generator=g)]
    shared = torch.randn(1, k, generator=g).to(torch.bfloat16)  # every weight reads it (gate_up)
    own = torch.randn(5, k, generator=g).to(torch.bfloat16)  # weight e reads row e (down)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for mode in _modes(ops):
            got = _grouped(ops, fmt, shared, ws, n, biases, mode)
            want = torch.cat([_one(ops, fmt, shared, w, n, b, mode) for w, b in zip(ws, biases)])
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), mode
            got = _grouped(ops, fmt, own, ws, n, biases, mode)
            want = torch.cat([_one(ops, fmt, own[e : e + 1], w, n, b, mode) for e, (w, b) in enumerate(zip(ws, biases))])
            assert torch.equal(got, want), mode
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_negative_control_rows_paired_with_the_wrong_weights_differ():
    """The comparison above tells weights apart: weight e fed another weight's row does not
    give weight e's own result."""
    ops = load_kernel()
    ws = _weights("q4", 3, 24, 64, seed=3)
    own = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = ops.q4_grouped_linear(own.flip(0), ws, 24, [None] * 3, 0)
    want = torch.cat([ops.q4_linear_layer(own[e : e + 1], w, 24, None, True, 0) for e, w in enumerate(ws)])
    assert not torch.equal(got, want)


@needs_kernel
def test_bad_arguments_are_refused():
    ops = load_kernel()
    ws = _weights("q4", 2, 16, 64, seed=5)
    x = torch.randn(1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="no weights"):
        ops.q4_grouped_linear(x, [], 16, [], 0)
    with pytest.raises(RuntimeError, match="1 row or one row per weight"):
        ops.q4_grouped_linear(torch.randn(3, 64), ws, 16, [None, None], 0)
    with pytest.raises(RuntimeError, match="first one's shape"):
        ops.q4_grouped_linear(x, [ws[0], _weights("q4", 1, 24, 64, seed=6)[0]], 16, [None, None], 0)
    with pytest.raises(RuntimeError, match="one bias entry per weight"):
        ops.q4_grouped_linear(x, ws, 16, [None], 0)
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        ops.q4_grouped_linear(x, ws, 16, [None, torch.randn(15)], 0)
    with pytest.raises(RuntimeError, match="in_features"):
        ops.q4_grouped_linear(torch.randn(1, 96), ws, 16, [None, None], 0)
    i8 = _weights("int8", 2, 16, 64, seed=7)
    with pytest.raises(RuntimeError, match="one scale per weight"):
        ops.int8_grouped_linear(x, [w[0] for w in i8], [i8[0][1]], 16, [None, None], 0)
