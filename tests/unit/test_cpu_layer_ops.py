"""The fused bf16 layer ops of the CPU kernel against the PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models.llama import apply_rope, rms_norm

pytestmark = pytest.mark.usefixtures("kernel")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops():
    from specdec.kernels.cpu_linear import load_kernel

    return load_kernel()


def _bf16(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_rope_is_bitwise_the_torch_rope(ops, rows):
    hq, hkv, d = 6, 2, 64
    qkv = _bf16(rows, (hq + 2 * hkv) * d, seed=rows, scale=3.0)
    angles = torch.arange(rows).float()[:, None] * torch.rand(d // 2)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)  # [rows, d]
    q, k = ops.rope_qk(qkv, cos, sin, hq, hkv, d)
    want_q = apply_rope(qkv[:, : hq * d].view(rows, hq, d), cos[:, None], sin[:, None])
    want_k = apply_rope(qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d), cos[:, None], sin[:, None])
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(ops, with_delta):
    h, delta, w = _bf16(40, 896, seed=1, scale=4.0), _bf16(40, 896, seed=2), _bf16(896, seed=3)
    summed, normed = ops.add_rms_norm(h, delta if with_delta else None, w, 1e-6)
    want_sum = h + delta if with_delta else h
    assert torch.equal(summed, want_sum)  # a bf16 add rounds the same way
    want = rms_norm(want_sum, w, 1e-6)
    # The mean of squares is correctly rounded here, PyTorch's float32 reduction may be an ulp
    # off: at most one bf16 step apart, and nearly always identical.
    diff = (normed.float() - want.float()).abs()
    assert bool((diff <= want.float().abs() * 2**-7 + 1e-30).all())
    assert (normed == want).float().mean() > 0.999


def test_silu_mul_is_bitwise_the_torch_ops(ops):
    gate_up = _bf16(7, 2 * 4864, seed=4, scale=3.0)
    gate, up = gate_up.split(4864, dim=-1)
    want = F.silu(gate) * up
    assert torch.equal(ops.silu_mul(gate_up), want)


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_f32w_matches_gemmas_norm(ops, with_delta):
    from specdec.models.gemma import gemma_rms_norm

    h, delta, w = _bf16(40, 1152, seed=5, scale=4.0), _bf16(40, 1152, seed=6), _bf16(1152, seed=7, scale=0.5)
    factor = 1.0 + w.float()  # what GemmaRMSNorm.factor() passes
    summed, normed = ops.add_rms_norm_f32w(h, delta if with_delta else None, factor, 1e-6)
    want_sum = h + delta if with_delta else h
    assert torch.equal(summed, want_sum)
    want = gemma_rms_norm(want_sum, w, 1e-6)
    diff = (normed.float() - want.float()).abs()
    assert bool((diff <= want.float().abs() * 2**-7 + 1e-30).all())
    assert (normed == want).float().mean() > 0.999
    # The negative control: Llama's arithmetic (the normed row rounded to bf16 before a bf16
    # weight) is what this op exists not to do.
    llama = ops.add_rms_norm(want_sum, None, factor.to(BF16), 1e-6)[1]
    assert (llama != want).float().mean() > 0.05


def test_gelu_tanh_mul_is_bitwise_the_torch_ops(ops):
    gate_up = _bf16(7, 2 * 6912, seed=8, scale=3.0)
    gate, up = gate_up.split(6912, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    assert torch.equal(ops.gelu_tanh_mul(gate_up), want)
    with pytest.raises(RuntimeError, match="weight must be a contiguous 1-D float32"):
        ops.add_rms_norm_f32w(gate.contiguous(), None, torch.ones(6912, dtype=BF16), 1e-6)


def test_rows_do_not_depend_on_the_call(ops):
    """Each row computed alone is bitwise the row computed in a bigger call."""
    h, delta, w = _bf16(9, 256, seed=5), _bf16(9, 256, seed=6), _bf16(256, seed=7)
    gate_up = _bf16(9, 2 * 384, seed=8)
    together = ops.add_rms_norm(h, delta, w, 1e-5)
    act = ops.silu_mul(gate_up)
    for i in range(9):
        alone = ops.add_rms_norm(h[i : i + 1], delta[i : i + 1], w, 1e-5)
        assert torch.equal(alone[0], together[0][i : i + 1]) and torch.equal(alone[1], together[1][i : i + 1])
        assert torch.equal(ops.silu_mul(gate_up[i : i + 1]), act[i : i + 1])


def test_bad_inputs_name_the_argument(ops):
    with pytest.raises(RuntimeError, match="h must be bfloat16"):
        ops.add_rms_norm(torch.zeros(2, 8), None, torch.zeros(8, dtype=BF16), 1e-6)
    with pytest.raises(RuntimeError, match="qkv width"):
        ops.rope_qk(torch.zeros(2, 10, dtype=BF16), torch.zeros(2, 2, dtype=BF16), torch.zeros(2, 2, dtype=BF16), 2, 1, 2)
    with pytest.raises(RuntimeError, match="gate_up width must be even"):
        ops.silu_mul(torch.zeros(2, 7, dtype=BF16))


def test_fused_forward_matches_the_plain_forward(tmp_path, monkeypatch):
    """A bf16 model's logits through the fused ops and through the PyTorch ops agree to bf16
    precision, and greedy decoding gives the same tokens."""
    from conftest import make_hf_model
    from helpers import ragged_prefill_logits, random_prompts

    from specdec import Generator, SamplingParams
    from specdec.models import llama
    from specdec.models.loading import load_model

    make_hf_model(
        "qwen2", seed=1, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, intermediate_size=384, num_hidden_layers=2,
    ).save_pretrained(tmp_path)  # fmt: skip
    model, _, _ = load_model(tmp_path, dtype="bfloat16")
    prompts = random_prompts(512, 4, seed=3)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    calls = []
    real = llama._fused_ops
    monkeypatch.setattr(llama, "_fused_ops", lambda embeds: calls.append(1) or real(embeds))
    fused_logits = ragged_prefill_logits(model, prompts)
    fused = Generator(target=model).generate(prompts, params)
    assert calls and real(torch.zeros(1, 4, dtype=BF16)) is not None  # the fused path ran
    monkeypatch.setattr(llama, "_fused_ops", lambda embeds: None)
    plain_logits = ragged_prefill_logits(model, prompts)
    plain = Generator(target=model).generate(prompts, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
    for a, b in zip(fused_logits, plain_logits):
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.02)
