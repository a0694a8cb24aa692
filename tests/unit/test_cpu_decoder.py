"""Every decoder layer in one kernel call (kernels/cpu_decoder.cpp) against the Python loop over
the same kernels: the same bits for prefill, decode and verify passes, hidden states included,
for Llama's layer (Qwen2), Qwen3's q/k norms and Qwen3-MoE's sparse MLPs (kernels/cpu_moe.cpp)."""

from __future__ import annotations

import pytest
import torch

from specdec.attention import CpuAttentionBackend, TorchAttentionBackend
from specdec.kv import KVCacheManager, PageAllocator

pytestmark = pytest.mark.usefixtures("kernel")


# Qwen2 (Llama's layer), Qwen3 (q/k norms), Qwen3-MoE (q/k norms; layers 0 and 2 sparse, 8
# experts top-3 with renormalisation, layer 1 a dense MLP) and Gemma 3 (its norms, gelu, q/k
# norms; a window of 4, shorter than the prompts, on layers 0 and 2, each with its own RoPE;
# kernels/cpu_decoder.cpp's gemma_layers), each three layers of hidden 256.
FAMILIES = {
    "qwen2": {},
    "qwen3": dict(model_type="qwen3", head_dim=64),
    "qwen3_moe": dict(
        model_type="qwen3_moe", head_dim=64, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1],
    ),
    "gemma3": dict(
        model_type="gemma3_text", head_dim=64, query_pre_attn_scalar=48, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", rope_theta=1e6, factor=2.0),
            sliding_attention=dict(rope_type="default", rope_theta=1e4),
        ),
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    from conftest import make_hf_model

    path = tmp_path_factory.mktemp(f"{request.param}-tiny")
    make_hf_model(
        "qwen2", seed=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, intermediate_size=384, num_hidden_layers=3, **FAMILIES[request.param],
    ).save_pretrained(path)  # fmt: skip
    return path


def _model(checkpoint, quantization):
    from specdec.models.loading import load_model
    from specdec.models.quantized import quantize_linears

    model, _, _ = load_model(checkpoint, dtype="bfloat16")
    return model if quantization is None else quantize_linears(model, quantization)


class Counter:
    """Counts the kernel's decoder_layers and gemma_layers calls (the stack ran) without
    changing them."""

    def __init__(self, monkeypatch):
        from specdec.kernels.cpu_linear import load_kernel

        self.calls, kernel = 0, load_kernel()
        for name in ("decoder_layers", "gemma_layers"):
            monkeypatch.setattr(kernel, name, self._counted(getattr(kernel, name)))

    def _counted(self, real):
        def counted(*args):
            self.calls += 1
            return real(*args)

        return counted


def _passes(model, backend, layers):
    """A ragged prefill of three prompts, then a 3-row chain verify pass of each, then one
    decode row each: ``[(logits, hidden_states)]`` per pass. ``layers``: hidden_layers."""
    prompts = [[5, 9, 11, 300, 2, 7, 8], [1, 2, 3], [400, 401, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    manager = KVCacheManager(PageAllocator(64), 4)
    kv = manager.add_pool(model.kv_spec("target"), "cpu")
    for i, p in enumerate(prompts):
        manager.add_sequence(i)
        manager.reserve(i, len(p) + 4)
    steps = [
        (prompts, [0, 0, 0]),
        ([[7, 8, 9], [10, 11, 12], [13, 14, 15]], [len(p) for p in prompts]),
        ([[20], [21], [22]], [len(p) + 3 for p in prompts]),
    ]
    out = []
    for tokens, starts in steps:
        layout = kv.layout([0, 1, 2], tokens, starts)
        plan = backend.plan(layout, model.attention_spec)
        result = model(layout, kv, backend, plan, hidden_layers=layers)
        out.append((result.logits, result.hidden_states))
    return out


@pytest.mark.parametrize("quantization", [None, "int8", "q4"])
def test_stack_is_bitwise_the_python_loop(checkpoint, quantization, monkeypatch):
    model = _model(checkpoint, quantization)
    layers = (0, 2, 3, 1)  # any order, the last layer's output (3) included
    counter = Counter(monkeypatch)
    stack = _passes(model, CpuAttentionBackend(), layers)
    assert counter.calls == 3
    monkeypatch.setenv("SPECDEC_DISABLE_CPU_DECODER", "1")
    loop = _passes(model, CpuAttentionBackend(), layers)
    assert counter.calls == 3  # the loop ran
    for (a_logits, a_hidden), (b_logits, b_hidden) in zip(stack, loop):
        assert torch.equal(a_logits, b_logits) and torch.equal(a_hidden, b_hidden)


def test_greedy_generation_is_the_same_with_and_without_the_stack(checkpoint, monkeypatch):
    from helpers import random_prompts

    from specdec import Generator, SamplingParams
    from specdec.proposers import PromptLookup

    model = _model(checkpoint, "q4")
    prompts = random_prompts(512, 4, seed=5)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    counter = Counter(monkeypatch)
    gen = Generator(target=model)
    spec = gen.with_proposer(PromptLookup(num_speculative_tokens=3))
    runs = [[o.token_ids for o in g.generate(prompts, params)] for g in (gen, spec)]
    assert counter.calls > 0
    monkeypatch.setenv("SPECDEC_DISABLE_CPU_DECODER", "1")
    calls = counter.calls
    runs += [[o.token_ids for o in g.generate(prompts, params)] for g in (gen, spec)]
    assert counter.calls == calls
    assert runs[0] == runs[1] == runs[2] == runs[3]


def test_replaced_weights_are_read_at_the_next_forward(checkpoint, monkeypatch):
    """The kernel's arguments are kept between forwards: a layer whose linear or norm weight is
    replaced after a forward must be read afresh, not served from what was kept."""
    from specdec.models.packed import PackedLinear

    model = _model(checkpoint, None)
    first = _passes(model, CpuAttentionBackend(), (3,))
    layer = model.layers[1]
    old = layer.mlp.down_proj
    linear = torch.nn.Linear(old.in_features, old.out_features, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=0.05)
    layer.mlp.down_proj = PackedLinear(linear, torch.bfloat16)
    layer.input_layernorm.weight = torch.nn.Parameter(layer.input_layernorm.weight * 2)
    Counter(monkeypatch)
    stack = _passes(model, CpuAttentionBackend(), (3,))
    monkeypatch.setenv("SPECDEC_DISABLE_CPU_DECODER", "1")
    loop = _passes(model, CpuAttentionBackend(), (3,))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(stack, loop))
    assert not torch.equal(stack[0][0], first[0][0])


def test_other_backends_and_layers_keep_the_python_loop(checkpoint, monkeypatch):
    model = _model(checkpoint, None)
    counter = Counter(monkeypatch)
    _passes(model, TorchAttentionBackend(), (3,))  # the reference backend: never the kernel
    assert counter.calls == 0
    model.layers[0].self_attn.o_proj = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    _passes(model, CpuAttentionBackend(), (3,))  # a plain nn.Linear does not fit the kernel
    assert counter.calls == 0


def test_bad_arguments_name_what_is_wrong(checkpoint):
    from specdec.kernels.cpu_linear import load_kernel
    from specdec.models.cpu_decoder import stack_arguments

    model = _model(checkpoint, None)
    if model.config.gemma is not None:
        pytest.skip("decoder_layers' own arguments (Gemma's stack: gemma_layers)")
    kernel, cfg = load_kernel(), model.config
    args = stack_arguments(model.layers, kernel)
    manager = KVCacheManager(PageAllocator(8), 4)
    kv = manager.add_pool(model.kv_spec("target"), "cpu")
    manager.add_sequence(0)
    manager.reserve(0, 2)
    layout = kv.layout([0], [[1, 2]], [0])
    plan = CpuAttentionBackend().plan(layout, model.attention_spec)
    tp = plan.torch_plan
    cos = sin = torch.zeros(2, cfg.head_dim, dtype=torch.bfloat16)

    def call(h, cache, slots, wanted=(3,)):
        return kernel.decoder_layers(
            h, args.norms, args.eps, args.qk_norms, args.qk_eps, *args.linears, args.moes, cos, sin, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cache, slots, plan.row_seq, plan.row_index, tp.kv_gather, plan.kv_lens,
            tp.mask, tp.spec.sm_scale, list(wanted),
        )  # fmt: skip

    h = torch.zeros(2, 256, dtype=torch.bfloat16)
    before = kv.pool.cache.clone()
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 32 is outside the pool of 32 slots"):
        call(h, kv.pool.cache, torch.tensor([0, 32]))
    with pytest.raises(ValueError, match="cache must be contiguous bf16"):
        call(h, kv.pool.cache.float(), tp.slot_mapping)
    with pytest.raises(ValueError, match="wanted layer 4 outside 0..3"):
        call(h, kv.pool.cache, tp.slot_mapping, wanted=(4,))
    with pytest.raises(ValueError, match="h must be contiguous bf16"):
        call(h.float(), kv.pool.cache, tp.slot_mapping)
    assert torch.equal(kv.pool.cache, before)  # refused before any KV was written
