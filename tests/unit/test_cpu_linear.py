"""The packed bf16 CPU kernel against its pure-torch reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.kernels.cpu_linear import (
    pack_weight,
    packed_linear,
    packed_linear_reference,
    unpack_weight,
)
from specdec.models.packed import PackedLinear, pack_linears

needs_kernel = pytest.mark.usefixtures("kernel")  # fails, not skips, when the build breaks


@pytest.mark.parametrize("shape", [(16, 8), (37, 24), (100, 64), (5, 3)])
def test_pack_roundtrip(shape):
    w = torch.randn(*shape).to(torch.bfloat16)
    packed = pack_weight(w)
    assert packed.shape == (-(-shape[0] // 16), shape[1], 16)
    assert torch.equal(unpack_weight(packed, shape[0]), w)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13, 40])
@pytest.mark.parametrize("out_features", [16, 37, 100])
def test_kernel_matches_reference(rows, out_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, 72, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 72, generator=g)
    packed = pack_weight(w)
    torch.testing.assert_close(
        packed_linear(x, packed, out_features),
        packed_linear_reference(x, packed, out_features),
        rtol=1e-5,
        atol=1e-5,
    )


@needs_kernel
def test_rows_are_batch_invariant():
    """A row's result does not depend on how many rows share the call (verify == decode)."""
    w = torch.randn(70, 96).to(torch.bfloat16)
    x = torch.randn(11, 96)
    packed = pack_weight(w)
    together = packed_linear(x, packed, 70)
    for i in range(11):
        assert torch.equal(packed_linear(x[i : i + 1], packed, 70), together[i : i + 1])
    assert torch.equal(packed_linear(x[3:8], packed, 70), together[3:8])


def test_packed_linear_module_matches_nn_linear():
    lin = nn.Linear(40, 30, bias=True).to(torch.bfloat16)
    layer = PackedLinear(lin, torch.float32)
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    ref = x.float() @ lin.weight.float().T + lin.bias.float()
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)


def test_pack_linears_replaces_only_bf16_linears():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    pack_linears(model)
    assert isinstance(model[0], PackedLinear)
    assert isinstance(model[1], nn.Linear)


@needs_kernel
@pytest.mark.parametrize("numel", [8, 8 * 7, 8 * 4096 * 3 + 8])
def test_read_stream_reads_every_block(numel):
    """The bandwidth probe reads all of the tensor: its checksum is the XOR of every 32-byte
    block, and changing any one block changes it."""
    from specdec.kernels.cpu_linear import load_kernel

    t = torch.randint(-(2**62), 2**62, (numel // 2,), dtype=torch.int64).view(torch.float32)
    want = 0
    for w in t.view(torch.int64).tolist():
        want ^= w
    kernel = load_kernel()
    assert kernel.read_stream(t) == want
    t.view(torch.int64)[-1] ^= 1
    assert kernel.read_stream(t) == want ^ 1


@needs_kernel
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_call_layer_rounds_like_the_torch_ops(x_dtype, out_dtype, with_bias):
    """Bias and rounding done in C++ give bitwise what ``(x.float() @ W.T + b).to(dtype)``
    gives in torch from the kernel's float32 product."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(53, 40, generator=g).to(torch.bfloat16)
    x = torch.randn(6, 40, generator=g).to(x_dtype)
    bias = torch.randn(53, generator=g) if with_bias else None
    packed = pack_weight(w)
    product = packed_linear(x, packed, 53)  # the kernel's float32 product for x's dtype
    want = (product if bias is None else product + bias).to(out_dtype)
    got = packed_linear(x, packed, 53, bias, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)


def _bf16_dot_kernel():
    from specdec.kernels.cpu_linear import load_kernel

    kernel = load_kernel()
    if kernel is None or not kernel.packed_has_bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16: the kernel's vdpbf16ps path does not run here")
    return kernel


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 13])
@pytest.mark.parametrize("in_features", [1, 2, 3, 6, 72, 73])
@pytest.mark.parametrize("out_features", [16, 30, 37])  # 30: a partial panel in a pair
def test_bf16_dot_path_matches_reference(rows, in_features, out_features):
    """The AVX512-BF16 path against the float64 product: only float32 rounding apart (its sums
    run in another order than the FMA path's), odd in_features included (a masked last row)."""
    _bf16_dot_kernel()
    g = torch.Generator().manual_seed(rows * 1000 + in_features * 10 + out_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    packed = pack_weight(w)
    got = packed_linear(x, packed, out_features, bf16_dot=1)
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T  # the error bound grows with sum |x w|
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert ((got.double() - exact).abs() <= 4 * in_features * 2.0**-24 * scale).all()


@needs_kernel
def test_bf16_dot_rows_are_batch_invariant():
    """Within the AVX512-BF16 path a row's bits do not depend on the rows beside it (blocks of
    eight rows, a partial block, 3-5 rows over two panels at a time, the row alone), so verify
    passes compute what decoding does."""
    _bf16_dot_kernel()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 99, generator=g).to(torch.bfloat16)  # odd in_features: the tail too
    x = torch.randn(19, 99, generator=g).to(torch.bfloat16)
    packed = pack_weight(w)
    together = packed_linear(x, packed, 70, bf16_dot=1)
    for i in range(19):
        assert torch.equal(packed_linear(x[i : i + 1], packed, 70, bf16_dot=1), together[i : i + 1])
    for start, stop in ((3, 9), (0, 3), (3, 7), (7, 12), (12, 14)):
        assert torch.equal(packed_linear(x[start:stop], packed, 70, bf16_dot=1), together[start:stop])


@needs_kernel
def test_bf16_dot_is_the_default_for_bf16_activations_only():
    """bf16 activations take the AVX512-BF16 path where the CPU has it, float32 ones the FMA
    path; the two differ in last bits on some inputs (another summation order), which is why the
    choice must depend on nothing but the CPU and the dtype."""
    _bf16_dot_kernel()
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    x = torch.randn(4, 512, generator=g).to(torch.bfloat16)
    packed = pack_weight(w)
    dot, fma = packed_linear(x, packed, 64, bf16_dot=1), packed_linear(x, packed, 64, bf16_dot=0)
    assert torch.equal(packed_linear(x, packed, 64), dot)
    assert torch.equal(packed_linear(x.float(), packed, 64), fma)
    assert not torch.equal(dot, fma)


@needs_kernel
def test_bf16_dot_bad_arguments_are_named():
    w = pack_weight(torch.randn(16, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bf16_dot must be None, 0 or 1"):
        packed_linear(torch.randn(1, 8), w, 16, bf16_dot=2)
    _bf16_dot_kernel()
    with pytest.raises(RuntimeError, match="bf16_dot=1 needs bfloat16 x"):
        packed_linear(torch.randn(1, 8), w, 16, bf16_dot=1)


@needs_kernel
@pytest.mark.parametrize("bf16_dot", [0, 1])
def test_two_threads_give_the_bits_of_one(bf16_dot):
    """Threads split the panels, never a sum: the same bits at one and two threads, for both
    paths. (The AVX512-BF16 path once passed a vector from the thread pool's lambda, compiled
    without AVX-512, by value: garbage on the second thread only.)"""
    if bf16_dot:
        _bf16_dot_kernel()
    g = torch.Generator().manual_seed(11)
    w = torch.randn(344, 64, generator=g).to(torch.bfloat16)  # 22 panels: both threads work
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    packed = pack_weight(w)
    one = packed_linear(x, packed, 344, bf16_dot=bf16_dot)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = packed_linear(x, packed, 344, bf16_dot=bf16_dot)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("module", ["cpu_int8", "cpu_q4"])
@pytest.mark.parametrize("disabled", [False, True])
def test_disable_avx512_asks_the_quantized_kernels_for_avx2(monkeypatch, module, disabled):
    """``SPECDEC_DISABLE_AVX512`` (how an AVX2-only CPU decodes, reproduced on an AVX-512 one)
    reaches the int8 and 4-bit kernels as ``use_vnni=0``; unset, they choose by the CPU (-1).
    Every path gives the same bits, so only the argument the kernel receives can tell."""
    import importlib

    mod = importlib.import_module(f"specdec.kernels.{module}")
    seen = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *args: seen.append(args[-1]) or torch.zeros(1, 16)

    monkeypatch.setattr(mod, "load_kernel", lambda: Recorder())
    monkeypatch.setattr(importlib.import_module("specdec.kernels.cpu_linear"), "avx512_disabled", lambda: disabled)
    fn = mod.int8_linear if module == "cpu_int8" else mod.q4_linear
    args = (
        (torch.zeros(1, 32), torch.zeros(1), torch.ones(16), 16)
        if module == "cpu_int8"
        else (torch.zeros(1, 32), torch.zeros(1), 16)
    )
    fn(*args)
    fn(*args, use_vnni=2)
    assert seen == [0 if disabled else -1, 2]


def test_disable_avx512_keeps_bf16_on_the_fma_path(monkeypatch):
    """The environment variable, read once per process, turns the bf16 default to the FMA path."""
    from specdec.kernels import cpu_linear

    for fn in (cpu_linear.avx512_disabled, cpu_linear.bf16_dot_mode):
        fn.cache_clear()
    monkeypatch.setenv("SPECDEC_DISABLE_AVX512", "1")
    try:
        assert cpu_linear.avx512_disabled() and cpu_linear.bf16_dot_mode() == 0
        assert cpu_linear.vnni_mode() == 0
        assert not cpu_linear.bf16_dot_available()
    finally:
        monkeypatch.delenv("SPECDEC_DISABLE_AVX512")
        for fn in (cpu_linear.avx512_disabled, cpu_linear.bf16_dot_mode):
            fn.cache_clear()
    assert not cpu_linear.avx512_disabled() and cpu_linear.bf16_dot_mode() == -1
    assert cpu_linear.vnni_mode() == -1


@pytest.mark.parametrize("quantization", [None, "q4"])
def test_replacing_the_linears_frees_each_old_one_as_it_goes(monkeypatch, quantization):
    """Packing or quantizing holds at most a layer or two of the old weights at once, not the
    whole model (a 7B bf16 model would need twice its memory to load)."""
    import gc
    import weakref

    from torch import nn

    from specdec.models import packed, quantized

    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)) for _ in range(8)])
    model = model.to(torch.bfloat16)
    olds = [weakref.ref(m) for m in model.modules() if isinstance(m, nn.Linear)]
    alive: list[int] = []
    cls = packed.PackedLinear if quantization is None else quantized.Q4Linear
    original = cls.__init__

    def counting(self, *args, **kwargs):
        gc.collect()
        alive.append(sum(r() is not None for r in olds))
        original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", counting)
    if quantization is None:
        packed.pack_linears(model)
    else:
        quantized.quantize_linears(model, quantization)
    # Before the i-th new layer, 16 - i old ones are still to be replaced; at most one sibling
    # more is alive (its parent's list of children). Holding them all would leave 16 each time.
    assert len(alive) == 16
    assert all(a <= 16 - i + 1 for i, a in enumerate(alive)), alive
