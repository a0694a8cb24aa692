"""Qwen3-MoE against Hugging Face transformers, the reference.

Qwen3-MoE is Qwen3's decoder whose sparse layers have a mixture of experts as their MLP
(:mod:`specdec.models.qwen3_moe`). Tiny random checkpoints written by transformers'
``save_pretrained`` (three layers, one of them dense through ``mlp_only_layers``; 8 experts
top-2 without renormalisation, and 4 experts top-2 with it, attention biases and tied
embeddings; norms far from 1) are loaded through specdec's loaders and compared with
transformers' own model of the same files (eager attention, eager experts):

- the router (softmax in float32, top-k, renormalisation, rounding) and the whole sparse block
  in bf16 bit for bit transformers'; experts that no token chose never run, each other one once;
- float64 logits of a ragged prefill; bf16 logits (packed linears, the fused per-layer ops with
  the experts as the MLP, or the whole-stack kernel; the experts' block in one kernel call,
  bit for bit its Python loop) within bf16 noise;
- greedy decoding equal to ``generate``: plain, with a Qwen3-MoE draft model, prompt lookup, an
  EAGLE tree and an MTP head (dense heads on the MoE target), and from a transformers object
  (experts stacked in 3-D tensors);
- bf16, int8 and q4 targets and drafts: speculative output equals the same model's plain output;
- negative controls: no renormalisation of the top-k, a softmax over the top-k logits only, and
  gate/up swapped in every expert disagree with transformers far beyond the tolerance;
- a GGUF file as llama.cpp writes ``qwen3moe`` (stacked ``ffn_*_exps``) loads densely;
  ``quantization="q4"`` straight from it is refused;
- configs specdec cannot honour, tensor parallelism and CUDA graphs are refused, naming why.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import (
    assert_greedy_as_transformers,
    bf16_error,
    bf16_reference,
    cpu_prefill_logits,
    gguf_writer,
    hf_greedy,
    hf_logits,
    ragged_prefill_logits,
    random_head,
    random_prompts,
    saved_checkpoints,
)

from specdec import Generator, SamplingParams
from specdec.models import llama, qwen3_moe
from specdec.models.llama import Architecture, ModelConfig
from specdec.models.loading import load_model, model_from_state_dict
from specdec.models.quantized import Int8Linear, Q4Linear
from specdec.proposers import DraftModel, EAGLETree, MTPHead, PromptLookup

F64 = torch.float64
HF_TOL = dict(rtol=1e-5, atol=2e-5)  # transformers' RMSNorm, RoPE and router softmax: float32
BF16_TOL = 0.05  # max |bf16 logits - reference| over the reference's range
NEW_TOKENS = 16
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    vocab_size=103,
    max_position_embeddings=256,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    mlp_only_layers=[1],  # layers 0 and 2 sparse, layer 1 Llama's MLP of intermediate_size
    rope_parameters=dict(rope_type="default", rope_theta=1e4),
    tie_word_embeddings=False,
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
    experts_implementation="eager",  # the loop of modeling_qwen3_moe.py (float64 too)
)
VARIANTS = {
    "base": {},
    "norm-topk": dict(
        num_experts=4, norm_topk_prob=True, attention_bias=True, tie_word_embeddings=True
    ),
}


def _hf_config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY, **overrides})


def make_qwen3_moe(variant: str = "base", seed: int = 0, *, draft_of=None, dtype=F64, **overrides):
    """A random transformers Qwen3-MoE of the tiny config (``overrides`` on the variant's);
    norms far from 1; ``draft_of``: that model's weights plus noise (a draft that agrees often)."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(**{**VARIANTS[variant], **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    torch.manual_seed(7 if draft_of is not None else seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if draft_of is not None:
                p.copy_(draft_of.get_parameter(name) + 0.03 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(variant, role) -> (directory saved by transformers, its model); role "draft" is a noisy
    copy of the target."""
    return saved_checkpoints(tmp_path_factory, make_qwen3_moe, "qwen3moe-")


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (8, 21)) -> list[list[int]]:
    return random_prompts(TINY["vocab_size"], n, seed, max_len=lengths[1], min_len=lengths[0])


def _max_errors(model, hf, prompts) -> list[float]:
    return [
        float((logits - hf_logits(hf, p)).abs().max())
        for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4))
    ]


def test_config_reads_qwen3_moe(checkpoint):
    path, hf = checkpoint()
    cfg = ModelConfig.from_hf_config(hf.config)
    assert cfg.architecture is Architecture.QWEN3_MOE and cfg.qk_norm
    assert cfg.moe == qwen3_moe.MoeTraits(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
        sparse_layers=(0, 2),
    )  # fmt: skip
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias) and cfg.sliding_window is None
    biased = ModelConfig.from_hf_config(checkpoint("norm-topk")[1].config)
    assert biased.moe.norm_topk_prob and biased.moe.num_experts == 4 and biased.tie_word_embeddings
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (True, True, False)
    model, _, _ = load_model(path, dtype="float64")
    sparse, dense = model.layers[0].mlp, model.layers[1].mlp
    assert isinstance(sparse, qwen3_moe.SparseMoeBlock) and len(sparse.experts) == 8
    assert tuple(sparse.experts[3].gate_up_proj.weight.shape) == (64, 64)  # gate and up fused
    assert isinstance(dense, llama.MLP) and dense.intermediate_size == 96
    want = hf.model.layers[2].mlp.experts
    got = model.layers[2].mlp.experts[5]
    assert torch.equal(got.gate_up_proj.weight, want.gate_up_proj[5])  # gate rows, then up rows
    assert torch.equal(got.down_proj.weight, want.down_proj[5])
    # decoder_sparse_step: transformers' rule (layer i sparse when (i + 1) % step == 0)
    stepped = ModelConfig.from_hf_config(_hf_config(mlp_only_layers=[], decoder_sparse_step=2))
    assert stepped.moe.sparse_layers == (1,)
    assert ModelConfig.from_hf_config(_hf_config(num_experts=0)).moe.sparse_layers == ()


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_the_sparse_block_in_bf16_is_transformers_bit_for_bit(norm_topk_prob):
    """The router (float32 softmax, top-k, renormalisation, rounding to bf16) and the experts'
    accumulation (bf16, ascending expert order) are transformers' eager ones, bit for bit."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

    config = _hf_config(norm_topk_prob=norm_topk_prob)
    torch.manual_seed(1)
    theirs = hf_moe.Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    cfg = ModelConfig.from_hf_config(config)
    ours = qwen3_moe.SparseMoeBlock(64, cfg.moe, torch.nn.functional.silu).to(torch.bfloat16)
    state = {"gate.weight": theirs.gate.weight}
    for e in range(8):
        state[f"experts.{e}.gate_up_proj.weight"] = theirs.experts.gate_up_proj[e]
        state[f"experts.{e}.down_proj.weight"] = theirs.experts.down_proj[e]
    ours.load_state_dict(state)
    x = torch.randn(1, 33, 64).to(torch.bfloat16)
    with torch.no_grad():
        _, want_weights, want_experts = theirs.gate(x[0])
        weights, experts = qwen3_moe.route(ours.gate(x[0]), 2, norm_topk_prob)
        assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)
        assert weights.dtype == torch.bfloat16
        assert torch.equal(ours(x[0]), theirs(x)[0])
        # A decode row takes the one-token path (no gather/scatter), the kernel's silu_mul too.
        from specdec.kernels.cpu_linear import load_kernel

        for ops in {None, load_kernel()}:
            for t in (0, 7, 32):
                assert torch.equal(ours(x[0, t : t + 1], ops), theirs(x[:, t : t + 1])[0])


def test_only_chosen_experts_run_once_each(checkpoint, monkeypatch):
    """Batched by expert: an expert runs once per layer on all of its rows, and not at all when
    no token chose it (a one-token pass runs top-k = 2 of the 8)."""
    calls: list[int] = []
    forward = qwen3_moe.Expert.forward

    def counting(self, x, ops=None):
        calls.append(x.shape[0])
        return forward(self, x, ops)

    monkeypatch.setattr(qwen3_moe.Expert, "forward", counting)
    model, _, _ = load_model(checkpoint()[0], dtype="float64")
    ragged_prefill_logits(model, [[5]])
    assert calls == [1, 1, 1, 1]  # two sparse layers, two experts each
    calls.clear()
    ragged_prefill_logits(model, _prompts(3, seed=1))
    assert len(calls) <= 2 * 8 and sum(calls) == 2 * 2 * sum(len(p) for p in _prompts(3, seed=1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_float64(checkpoint, variant):
    path, hf = checkpoint(variant)
    model, _, _ = load_model(path, dtype="float64")
    prompts = _prompts(4, seed=1)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4)):
        torch.testing.assert_close(logits, hf_logits(hf, p), **HF_TOL)


# --- negative controls: one Qwen3-MoE detail done wrong, the rest as it is ----------------------


def _route_without_renormalisation(logits, top_k, norm_topk_prob):
    return _ROUTE(logits, top_k, False)


def _softmax_over_top_k(logits, top_k, norm_topk_prob):
    """The top-k logits' own softmax (what renormalisation gives, so a bug only without it)."""
    top, experts = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=torch.float32).to(logits.dtype), experts


def _gate_up_swapped(self, x, ops=None):
    up, gate = self.gate_up_proj(x).split(self.width, dim=-1)
    return self.down_proj(self.act(gate) * up)


_ROUTE = qwen3_moe.route
NEGATIVE_CONTROLS = {  # control -> (variant where it is a bug, patch)
    "no-renormalisation": ("norm-topk", (qwen3_moe, "route", _route_without_renormalisation)),
    "softmax-over-top-k": ("base", (qwen3_moe, "route", _softmax_over_top_k)),
    "gate-up-swapped": ("base", (qwen3_moe.Expert, "forward", _gate_up_swapped)),
}


@pytest.mark.parametrize("control", list(NEGATIVE_CONTROLS))
def test_negative_controls_disagree(checkpoint, monkeypatch, control):
    """Each control is the code a plausible bug would leave; its logits must leave the float64
    tolerance (2e-5) far behind, or the parity test above could not catch that bug. The model
    is read from transformers' in-memory state dict (experts stacked in 3-D tensors); without
    the patch it agrees."""
    variant, patch = NEGATIVE_CONTROLS[control]
    _, hf = checkpoint(variant)
    model = model_from_state_dict(
        ModelConfig.from_hf_config(hf.config), iter(hf.state_dict().items()),
        dtype=F64, device=torch.device("cpu"),
    )  # fmt: skip
    prompts = _prompts(4, seed=1)
    assert max(_max_errors(model, hf, prompts)) < 2e-5
    monkeypatch.setattr(*patch)
    errors = _max_errors(model, hf, prompts)
    assert min(errors) > 0.1, errors  # 0.95-4.9 seen


# --- bf16 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "loop"])
def test_logits_match_transformers_bf16_through_the_fused_ops(checkpoint, kernel, monkeypatch, stack):
    """Packed bf16 linears (experts and router included), the CPU attention kernel and the
    experts in one kernel call (``SparseMoe``), inside the whole-stack kernel or the per-layer
    loop of fused ops (``SPECDEC_DISABLE_CPU_DECODER``)."""
    from specdec.models import cpu_decoder
    from specdec.models.packed import PackedLinear

    ran, run_stack = [], cpu_decoder.run_stack
    fused = []
    layer_states = llama.LlamaModel._fused_layer_states
    monkeypatch.setattr(cpu_decoder, "run_stack", lambda *a: ran.append(1) or run_stack(*a))
    monkeypatch.setattr(
        llama.LlamaModel, "_fused_layer_states", lambda *a: fused.append(1) or layer_states(*a)
    )
    if not stack:
        monkeypatch.setenv("SPECDEC_DISABLE_CPU_DECODER", "1")
    path, hf = checkpoint()
    model, _, _ = load_model(path, dtype="bfloat16")  # packed
    block = model.layers[0].mlp
    assert isinstance(block.gate, PackedLinear)
    assert isinstance(block.experts[0].down_proj, PackedLinear)
    prompts = _prompts(4, seed=3)
    ref = bf16_reference(hf)
    ours = cpu_prefill_logits(model, prompts)
    assert (len(ran), len(fused)) == ((1, 0) if stack else (0, 1))  # one forward
    errors = [bf16_error(o, hf_logits(ref, p, torch.float32)) for p, o in zip(prompts, ours)]
    assert max(errors) < BF16_TOL, errors
    for a, b in zip(ours, ragged_prefill_logits(model, prompts)):  # the torch backend, plain layers
        assert bf16_error(a, b) < 0.02


class _Counting:
    """The kernel module, counting the ``SparseMoe`` objects it makes and their forwards."""

    def __init__(self, ops):
        self.ops, self.calls, self.made = ops, 0, 0

    def SparseMoe(self, *args):  # noqa: N802 (the kernel's class)
        self.made += 1
        kernel, counter = self.ops.SparseMoe(*args), self

        class Counted:
            def forward(self, x):
                counter.calls += 1
                return kernel.forward(x)

        return Counted()

    def __getattr__(self, name):
        return getattr(self.ops, name)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q4"])
@pytest.mark.parametrize(("norm_topk_prob", "hidden"), [(False, 64), (True, 64), (True, 60)])
def test_the_sparse_block_kernel_is_the_python_loop_bit_for_bit(kernel, fmt, norm_topk_prob, hidden):
    """``kernels/cpu_moe.cpp`` (router, softmax, top-k, experts in one call) gives the bits of
    the block's Python loop, for one decode row and for ragged many-row passes (experts with 0,
    1 and many rows), packed bf16, int8 and q4; replacing an expert's projection afterwards is
    seen (the kept arguments are checked against the modules at every call). A hidden size
    that is no multiple of 8 takes the weighted sum's scalar tail."""
    from specdec.kernels.cpu_linear import load_kernel
    from specdec.models.packed import pack_linears
    from specdec.models.quantized import quantize_linears

    torch.manual_seed(3)
    cfg = ModelConfig.from_hf_config(_hf_config(norm_topk_prob=norm_topk_prob, num_experts=8, num_experts_per_tok=3))
    block = qwen3_moe.SparseMoeBlock(hidden, cfg.moe, torch.nn.functional.silu).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    holder = torch.nn.Sequential(block)
    if fmt == "bf16":
        pack_linears(holder)
    else:
        quantize_linears(holder, fmt)
    ops = _Counting(load_kernel())
    x = torch.randn(23, hidden).to(torch.bfloat16)

    for rows in (x[:1], x[5:6], x[:2], x[3:12], x):
        before = ops.calls
        got = block(rows, ops)
        assert ops.calls == before + 1
        assert torch.equal(got, block.loop(rows, ops.ops))
    # every row alone is the same row of a many-row pass (speculative == plain)
    assert torch.equal(torch.cat([block(x[t : t + 1], ops) for t in range(23)]), block(x, ops))
    assert ops.made == 1  # read once, kept while the modules stay
    before = block.loop(x, ops.ops)
    for e in range(8):  # zero every expert's down projection: the output must follow
        old = block.experts[e].down_proj
        linear = torch.nn.Linear(32, hidden, bias=False).to(torch.bfloat16)
        torch.nn.init.zeros_(linear.weight)
        holder = torch.nn.Sequential(linear)
        pack_linears(holder) if fmt == "bf16" else quantize_linears(holder, fmt)
        block.experts[e].down_proj = holder[0]
        assert type(block.experts[e].down_proj) is type(old)
        assert torch.equal(block(x, ops), block.loop(x, ops.ops))
    assert ops.made == 9 and torch.equal(block(x, ops), torch.zeros_like(x)) and not torch.equal(before, torch.zeros_like(x))


# --- decoding -----------------------------------------------------------------------------------


def _random_eagle3_head(target, seed: int = 0):
    """A random EAGLE-3 head on the inputs of layers 0 and 1 and the last output: a Llama layer
    with a dense MLP whatever the target."""
    from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind

    torch.manual_seed(seed)
    cfg = EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=(0, 1, 3))
    head = EagleHeadModel(target, cfg)
    assert head.layer_config.moe is None and isinstance(head.layer.mlp, llama.MLP)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return head.to(target.dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("proposer", ["plain", "draft-model", "prompt-lookup", "eagle-tree", "mtp"])
def test_greedy_generation_matches_transformers(checkpoint, proposer):
    path, hf = checkpoint()
    target, _, _ = load_model(path, dtype="float64")
    k, drafts = 3, None
    if proposer == "draft-model":
        draft_path, _ = checkpoint("base", "draft")
        drafts = DraftModel.from_pretrained(draft_path, dtype="float64", num_speculative_tokens=k)
    elif proposer == "prompt-lookup":
        drafts = PromptLookup(k)
    elif proposer == "eagle-tree":
        drafts = EAGLETree.from_model(_random_eagle3_head(target), None)  # a dynamic tree
        k = drafts.num_speculative_tokens
    elif proposer == "mtp":  # its layer: Qwen3's, with a dense MLP
        head = random_head(target, 1)
        assert isinstance(head.layer.mlp, llama.MLP) and head.layer.self_attn.q_norm is not None
        drafts = MTPHead.from_model(head)
        k = drafts.num_speculative_tokens
    prompts = _prompts(4, seed=2, lengths=(6, 16))
    prompts[0] = prompts[0][:3] * 4  # repeats: prompt lookup has something to find
    assert_greedy_as_transformers(target, hf, drafts, k, prompts, NEW_TOKENS,
                                  expect_accepted=proposer == "draft-model")  # fmt: skip


def test_a_transformers_object_decodes_as_itself(checkpoint):
    """``Generator.from_pretrained(hf_model)``: the object's experts are stacked 3-D tensors."""
    _, hf = checkpoint("norm-topk")
    gen = Generator.from_pretrained(hf, dtype="float64")
    prompts = _prompts(2, seed=9)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("quantization", [None, "int8", "q4"], ids=["bf16", "int8", "q4"])
def test_speculation_equals_plain_through_the_cpu_kernels(checkpoint, kernel, quantization):
    """bf16 (packed), int8 and q4 targets and drafts on the CPU backend, experts and router in
    the format: each row is computed alone, so a speculative run emits exactly the same model's
    plain tokens."""
    path, _ = checkpoint()
    draft_path, _ = checkpoint("base", "draft")
    target, _, _ = load_model(path, quantization=quantization)
    if quantization is not None:
        cls = Int8Linear if quantization == "int8" else Q4Linear
        block = target.layers[2].mlp
        assert isinstance(block.gate, cls) and isinstance(block.experts[7].gate_up_proj, cls)
        assert isinstance(target.layers[1].mlp.down_proj, cls)
    cached, _, _ = load_model(path, quantization=quantization)  # the disk cache's copy
    ours, theirs = target.state_dict(), cached.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    prompts = _prompts(4, seed=5, lengths=(6, 16))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = Generator.from_components(target).generate(prompts, params)
    draft = DraftModel.from_pretrained(
        draft_path, quantization=quantization, num_speculative_tokens=3
    )
    spec = Generator.from_components(target, proposer=draft, policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.metrics.num_accepted > 0


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("num_experts_per_tok", dict(num_experts_per_tok=9)),
        ("num_experts_per_tok", dict(num_experts_per_tok=0)),
        ("decoder_sparse_step", dict(decoder_sparse_step=0)),
        ("moe_intermediate_size", dict(moe_intermediate_size=0)),
        ("mlp_only_layers", dict(mlp_only_layers="1")),
        ("layer_types", dict(layer_types=["full_attention"] * 3, sliding_window=4)),
        ("hidden_act", dict(hidden_act="prelu")),
        ("quantization_config", dict(quantization_config={"quant_method": "gptq"})),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_configs_specdec_cannot_honour_are_refused(field, overrides):
    """The config with ``overrides`` set after construction (as in a config.json that
    transformers' own validation would not have let through) is refused, naming ``field``."""
    cfg = _hf_config()
    for name, value in overrides.items():
        object.__setattr__(cfg, name, value)  # past the config class's own type checks
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    with pytest.raises(ValueError, match=rf"config field {field}=.*\(supported: "):
        ModelConfig.from_hf_config(cfg)


def test_router_training_fields_are_ignored_and_a_window_is_honoured():
    """``output_router_logits``/``router_aux_loss_coef`` change nothing at inference; a window
    (``use_sliding_window``) applies to every layer, as transformers' attention applies it."""
    hf = make_qwen3_moe(
        seed=5, output_router_logits=True, router_aux_loss_coef=0.5, use_sliding_window=True,
        sliding_window=4,
    )  # fmt: skip
    cfg = ModelConfig.from_hf_config(hf.config)
    assert cfg.sliding_window == 4 and cfg.moe.sparse_layers == (0, 2)
    model = model_from_state_dict(
        cfg, iter(hf.state_dict().items()), dtype=F64, device=torch.device("cpu")
    )
    prompts = _prompts(3, seed=6)  # 8-20 tokens: most rows see past the window
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4)):
        torch.testing.assert_close(logits, hf_logits(hf, p), **HF_TOL)
    unwindowed = model_from_state_dict(
        attrs.evolve(cfg, sliding_window=None), iter(hf.state_dict().items()),
        dtype=F64, device=torch.device("cpu"),
    )  # fmt: skip
    assert max(_max_errors(unwindowed, hf, prompts)) > 0.1  # the control: the window matters


def test_tensor_parallel_and_cuda_graphs_are_refused(checkpoint):
    from specdec.distributed.sharding import check_shardable
    from specdec.graphs import EagerCapture, PassGraphs

    target, _, _ = load_model(checkpoint()[0], dtype="float64")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*qwen3_moe \(Qwen3-MoE\)"):
        check_shardable(target.config, 2)
    check_shardable(target.config, 1)
    with pytest.raises(ValueError, match=r"cuda_graphs=True is not supported for qwen3_moe"):
        PassGraphs(target, None, lambda b, r: None, EagerCapture())


# --- GGUF files as llama.cpp writes qwen3moe (the gguf package) ---------------------------------

_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps",
}
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
GGUF_EPS = 2.0**-20  # exact in float32: the file's eps is the config's, bit for bit


def _gguf_tensors(model):
    """``model``'s tensors under llama.cpp's qwen3moe names: the experts stacked 3-D
    (``ffn_gate_exps``, ``ffn_up_exps``: [experts, moe_intermediate, hidden]; ``ffn_down_exps``)."""
    import re

    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            yield f"{_GGUF_TOP[module]}.{leaf}", tensor
            continue
        layer, inner = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if inner == "mlp.experts.gate_up_proj":  # transformers' layout: gate rows, then up rows
            gate, up = tensor.chunk(2, dim=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate
            yield f"blk.{layer}.ffn_up_exps.weight", up
        elif inner == "mlp.experts.down_proj":
            yield f"blk.{layer}.ffn_down_exps.weight", tensor
        else:
            module, _, leaf = inner.rpartition(".")
            yield f"blk.{layer}.{_GGUF_BLOCK[module]}.{leaf}", tensor


def write_qwen3_moe_gguf(path, model) -> None:
    """``model`` (float32, every layer sparse) as llama.cpp's convert_hf_to_gguf.py writes
    Qwen3-MoE (``Qwen3MoeModel``): Qwen3's names and keys, the router as ``ffn_gate_inp``, the
    experts stacked in ``ffn_{gate,up,down}_exps``, their counts and width as ``expert_*`` keys;
    F32 throughout."""
    import gguf

    cfg = model.config
    writer = gguf_writer(path, "qwen3moe", cfg, head_dim=True)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, tensor in _gguf_tensors(model):
        writer.add_tensor(name, tensor.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """(GGUF file, its float64 transformers source model: every layer sparse, top-k renormalised
    as llama.cpp's qwen3moe computes it)."""
    pytest.importorskip("gguf")
    source = make_qwen3_moe(seed=3, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=GGUF_EPS)
    path = tmp_path_factory.mktemp("gguf-qwen3moe") / "tiny-qwen3moe-f32.gguf"
    with torch.no_grad():  # values exact in float32: the file holds the source's weights
        for p in source.parameters():
            p.copy_(p.float().double())
    write_qwen3_moe_gguf(path, source)
    return path, source


def test_gguf_loads_as_its_source(gguf_file):
    """A qwen3moe F32 file: the config is its source's (experts, width, top-k renormalised, every
    layer sparse) and its float64 logits are transformers' within the float64 tolerance."""
    path, source = gguf_file
    model, _, _ = load_model(path, dtype="float64")
    want = ModelConfig.from_hf_config(source.config)
    assert want.moe.sparse_layers == (0, 1, 2) and want.moe.norm_topk_prob
    assert attrs.evolve(model.config, eos_token_ids=()) == attrs.evolve(want, eos_token_ids=())
    prompts = _prompts(3, seed=4)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts)):
        torch.testing.assert_close(logits, hf_logits(source, p), **HF_TOL)


def test_gguf_q4_straight_from_the_file_is_refused(gguf_file):
    refusal = r"quantization='q4' straight from a GGUF file is not implemented for qwen3moe"
    with pytest.raises(ValueError, match=refusal):
        load_model(gguf_file[0], quantization="q4")
