"""bf16 speculation is exact only if attention is batch-invariant: the CPU kernel backend (the
default) keeps speculative greedy == plain greedy on a bf16 model with long outputs, where
float32 SDPA (different kernels for one row and for a masked verify pass) does not."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_model
from helpers import random_prompts

from specdec import FixedPolicy, Generator, SamplingParams
from specdec.attention import CpuAttentionBackend, TorchAttentionBackend, default_backend
from specdec.models.loading import load_model
from specdec.models.packed import pack_linears
from specdec.proposers import DraftModel

pytestmark = pytest.mark.usefixtures("kernel")


class Float32Sdpa(TorchAttentionBackend):
    """The negative control: the reference in float32 instead of float64 for bf16 models."""

    def run(self, plan, q, k, v, k_pages, v_pages):
        spec = plan.spec
        k_pages.view(-1, spec.num_kv_heads, spec.head_dim).index_copy_(0, plan.slot_mapping, k.to(k_pages.dtype))
        v_pages.view(-1, spec.num_kv_heads, spec.head_dim).index_copy_(0, plan.slot_mapping, v.to(v_pages.dtype))
        out = super().run(plan, q.float(), k.float(), v.float(), k_pages.float(), v_pages.float())
        return out.to(q.dtype)


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16-qwen2")
    make_hf_model(
        "qwen2", seed=1, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, intermediate_size=384, num_hidden_layers=2,
    ).save_pretrained(path)  # fmt: skip
    target, _, _ = load_model(path, dtype="bfloat16", pack=True)
    draft, _, _ = load_model(path, dtype="bfloat16", pack=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn_like(p))
    return target, pack_linears(draft)


def _identical(target, draft, backend) -> tuple[int, int]:
    prompts = random_prompts(512, 8, seed=3)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    plain = Generator(target=target, backend=backend).generate(prompts, params)
    gen = Generator(
        target=target,
        proposer=DraftModel.from_model(draft, num_speculative_tokens=4),
        policy=FixedPolicy(4),
        backend=backend,
    )
    spec = gen.generate(prompts, params)
    assert 0 < gen.metrics.num_accepted < gen.metrics.num_drafted
    return sum(a.token_ids == b.token_ids for a, b in zip(spec, plain)), len(prompts)


def test_the_default_cpu_backend_is_the_kernel():
    assert isinstance(default_backend("cpu"), CpuAttentionBackend)


def test_kernel_attention_keeps_bf16_speculation_exact(bf16_pair):
    same, n = _identical(*bf16_pair, default_backend("cpu"))
    assert same == n


def test_negative_control_float32_sdpa_breaks_bf16_speculation(bf16_pair):
    same, n = _identical(*bf16_pair, Float32Sdpa())
    assert same < n
