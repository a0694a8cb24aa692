"""OLMo 2 against Hugging Face transformers, the reference.

Tiny random checkpoints written by transformers' ``save_pretrained`` (three layers, grouped KV
heads, untied LM head; a second one with attention biases and linear RoPE scaling; norm weights
far from 1, so that every norm matters) are loaded through specdec's loaders and compared with
transformers' own model of the same files (eager attention):

- float64 logits of a ragged prefill; bf16 logits (packed linears, the CPU attention kernel)
  within bf16 noise, and neither of the CPU kernels' fused paths (Llama's layer) is ever
  taken; OLMo 2's norm and RoPE in bf16 bit for bit transformers' (float32, rounded once);
- greedy decoding equal to ``generate``: plain, with an OLMo 2 draft model, prompt lookup and an
  EAGLE tree (the head is a Llama layer on the OLMo 2 target's hidden states);
- bf16, int8 and q4 targets and drafts: speculative output equals the same model's plain output;
- negative controls: the same weights with one OLMo 2 difference done wrong (q/k norms per
  head, norms before the sub-blocks, q/k norms after RoPE, no q/k norms) disagree with
  transformers far beyond the tolerance;
- GGUF files as llama.cpp writes ``olmo2`` load densely and as q4 (OLMo 3 files, also written as
  ``olmo2``, are refused);
- configs specdec cannot honour, MTP heads and tensor parallelism are refused, naming the field.
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
    random_prompts,
    saved_checkpoints,
)

from specdec import Generator, SamplingParams
from specdec.models import llama, olmo2
from specdec.models.llama import Architecture, ModelConfig
from specdec.models.loading import load_model, model_from_state_dict
from specdec.models.quantized import Int8Linear, Q4Linear
from specdec.proposers import DraftModel, EAGLETree, PromptLookup

F64 = torch.float64
HF_TOL = dict(rtol=1e-5, atol=2e-5)  # transformers runs OLMo 2's RMSNorm in float32
BF16_TOL = 0.05  # max |bf16 logits - reference| over the reference's range (0.005-0.007 seen)
NEW_TOKENS = 20
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=103,
    max_position_embeddings=256,
    rope_parameters=dict(rope_type="default", rope_theta=1000.0),
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
)
VARIANTS = {
    "base": {},
    "bias-rope-scaling": dict(
        attention_bias=True, rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=500.0)
    ),
}


def _hf_config(**overrides):
    from transformers import Olmo2Config

    return Olmo2Config(**{**TINY, **overrides})


def _randomize(model, seed: int, draft_of=None):
    """Random weights, norm weights around 1 with a spread (every norm matters); ``draft_of``:
    that model's weights plus noise (a draft that agrees often)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if draft_of is not None:
                p.copy_(draft_of.get_parameter(name) + 0.03 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def make_olmo2(variant: str = "base", seed: int = 0, *, draft_of=None, dtype=F64):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_hf_config(**VARIANTS[variant]), dtype=dtype).eval()
    return _randomize(model, seed=7 if draft_of is not None else seed, draft_of=draft_of)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(variant, role) -> (directory saved by transformers, its model); role "draft" is a noisy
    copy of the target."""
    return saved_checkpoints(tmp_path_factory, make_olmo2, "olmo2-")


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (8, 21)) -> list[list[int]]:
    return random_prompts(TINY["vocab_size"], n, seed, max_len=lengths[1], min_len=lengths[0])


_cpu_prefill_logits = cpu_prefill_logits


def test_config_reads_olmo2(checkpoint):
    _, hf = checkpoint()
    cfg = ModelConfig.from_hf_config(hf.config)
    assert cfg.architecture is Architecture.OLMO2 and cfg.olmo2
    assert not cfg.qk_norm and cfg.gemma is None  # OLMo 2's own q/k norms, not Qwen3's
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and not cfg.tie_word_embeddings
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, False)
    assert cfg.sliding_window is None and cfg.attention_spec.sm_scale == 16**-0.5
    _, biased = checkpoint("bias-rope-scaling")
    cfg = ModelConfig.from_hf_config(biased.config)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (True, True, False)  # the MLP has none
    torch.testing.assert_close(torch.tensor(cfg.inv_freq), biased.model.rotary_emb.inv_freq, rtol=0, atol=0)
    # mlp_bias is not read by transformers' Olmo2 (its MLP has no biases): not by specdec either
    assert ModelConfig.from_hf_config(_hf_config(mlp_bias=True)).mlp_bias is False


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_float64(checkpoint, variant):
    path, hf = checkpoint(variant)
    model, _, _ = load_model(path, dtype="float64")
    layer = model.layers[0]
    assert isinstance(layer, olmo2.Olmo2DecoderLayer) and not hasattr(layer, "input_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (64,) and layer.self_attn.k_norm.weight.shape == (32,)
    torch.testing.assert_close(
        layer.self_attn.k_norm.weight, hf.model.layers[0].self_attn.k_norm.weight, rtol=0, atol=0
    )
    prompts = _prompts(4, seed=1)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4)):
        torch.testing.assert_close(logits, hf_logits(hf, p), **HF_TOL)


# --- negative controls: one OLMo 2 difference done wrong, the rest as it is ---------------------


def _per_head_qk_norm(self, x, cos, sin, layer_kv, backend, plan):
    """Qwen3's q/k norms (each head's channels alone) with OLMo 2's weights."""
    n, d = x.shape[0], self.head_dim
    q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
    q = olmo2.olmo2_rms_norm(q.reshape(n, -1, d), self.q_norm.weight.view(-1, d), self.q_norm.eps)
    k = olmo2.olmo2_rms_norm(k.reshape(n, -1, d), self.k_norm.weight.view(-1, d), self.k_norm.eps)
    out = backend.run(plan, olmo2.rotate(q, cos, sin), olmo2.rotate(k, cos, sin), v.view(n, -1, d), *layer_kv)
    return self.o_proj(out.reshape(n, self.q_size))


def _qk_norm_after_rope(self, x, cos, sin, layer_kv, backend, plan):
    n, d = x.shape[0], self.head_dim
    q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
    q = self.q_norm(olmo2.rotate(q.reshape(n, -1, d), cos, sin).reshape(n, -1)).view(n, -1, d)
    k = self.k_norm(olmo2.rotate(k.reshape(n, -1, d), cos, sin).reshape(n, -1)).view(n, -1, d)
    out = backend.run(plan, q, k, v.view(n, -1, d), *layer_kv)
    return self.o_proj(out.reshape(n, self.q_size))


def _pre_norms(self, h, cos, sin, layer_kv, backend, plan):
    """Llama's order with OLMo 2's norms: each norm before its sub-block."""
    h = h + self.self_attn(self.post_attention_layernorm(h), cos, sin, layer_kv, backend, plan)
    return h + self.mlp(self.post_feedforward_layernorm(h))


NEGATIVE_CONTROLS = {
    "per-head-qk-norm": (olmo2.Olmo2Attention, "forward", _per_head_qk_norm),
    "qk-norm-after-rope": (olmo2.Olmo2Attention, "forward", _qk_norm_after_rope),
    "pre-norms": (olmo2.Olmo2DecoderLayer, "forward", _pre_norms),
    "no-qk-norms": None,  # the q/k norm modules replaced by identities: below
}


@pytest.mark.parametrize("control", list(NEGATIVE_CONTROLS))
def test_negative_controls_disagree(checkpoint, monkeypatch, control):
    """Each control is the code a plausible bug would leave; its logits must leave the float64
    tolerance (2e-5) far behind, or the parity test above could not catch that bug."""
    _, hf = checkpoint()
    model = model_from_state_dict(
        ModelConfig.from_hf_config(hf.config), iter(hf.state_dict().items()), dtype=F64, device=torch.device("cpu")
    )
    if NEGATIVE_CONTROLS[control] is None:
        for layer in model.layers:
            monkeypatch.setattr(layer.self_attn.q_norm, "forward", lambda x: x)
            monkeypatch.setattr(layer.self_attn.k_norm, "forward", lambda x: x)
    else:
        monkeypatch.setattr(*NEGATIVE_CONTROLS[control])
    prompts = _prompts(4, seed=1)
    errors = [
        float((logits - hf_logits(hf, p)).abs().max())
        for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4))
    ]
    assert max(errors) > 0.1, errors  # 1.4-8.9 seen


# --- bf16 ---------------------------------------------------------------------------------------


def test_norm_and_rope_in_bf16_are_transformers_bit_for_bit():
    """OLMo 2 multiplies its norm weight in float32 and rotates with float32 tables, rounding
    once; Llama's arithmetic (rounded, then multiplied) differs in bf16."""
    from transformers.models.olmo2 import modeling_olmo2 as hf_olmo2

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    norm = hf_olmo2.Olmo2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(64, generator=g))
        want = norm(x)
    assert torch.equal(olmo2.olmo2_rms_norm(x, norm.weight, 1e-6), want)
    assert not torch.equal(llama.rms_norm(x, norm.weight, 1e-6), want)  # the check can fail
    cos, sin = llama.rope_tables(torch.arange(7), torch.rand(8, generator=g), 1.0, torch.float32)
    q = torch.randn(7, 4, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(7, 2, 16, generator=g).to(torch.bfloat16)
    want_q, want_k = hf_olmo2.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.squeeze(1)[None], sin.squeeze(1)[None]
    )
    assert torch.equal(olmo2.rotate(q, cos, sin), want_q[0].transpose(0, 1))
    assert torch.equal(olmo2.rotate(k, cos, sin), want_k[0].transpose(0, 1))
    llama_q = llama.apply_rope(q, cos.to(torch.bfloat16), sin.to(torch.bfloat16))  # bf16 tables
    assert not torch.equal(llama_q, want_q[0].transpose(0, 1))


def test_logits_match_transformers_bf16_through_olmo2s_fused_path(checkpoint, kernel, monkeypatch):
    """Packed bf16 linears and the CPU backend's attention kernel through OLMo 2's own fused
    per-layer ops (:func:`specdec.models.olmo2.fused_layer_states`: its norms); Llama's fused
    per-layer ops and the whole-stack kernel compute Llama's layer and are never entered. The
    fused path equals the layers' own modules within bf16 noise."""
    from specdec.models import cpu_decoder, olmo2

    def forbidden(*args, **kwargs):
        raise AssertionError("a Llama fused CPU path ran an OLMo 2 layer")

    monkeypatch.setattr(cpu_decoder, "run_stack", forbidden)
    monkeypatch.setattr(llama.LlamaModel, "_fused_layer_states", forbidden)
    calls = []
    fused = olmo2.fused_layer_states
    monkeypatch.setattr(olmo2, "fused_layer_states", lambda *a: calls.append(1) or fused(*a))
    path, hf = checkpoint()
    model, _, _ = load_model(path, dtype="bfloat16")  # packed
    prompts = _prompts(4, seed=3)
    ref = bf16_reference(hf)
    ours = _cpu_prefill_logits(model, prompts)
    assert calls  # OLMo 2's fused path ran
    errors = [bf16_error(o, hf_logits(ref, p, torch.float32)) for p, o in zip(prompts, ours)]
    assert max(errors) < BF16_TOL, errors
    reference_attention = ragged_prefill_logits(model, prompts)  # the torch backend
    for a, b in zip(ours, reference_attention):
        assert bf16_error(a, b) < 0.02
    monkeypatch.setattr(llama, "_fused_ops", lambda embeds: None)  # the layers' own modules
    for a, b in zip(ours, _cpu_prefill_logits(model, prompts)):
        assert bf16_error(a, b) < 0.02


# --- decoding -----------------------------------------------------------------------------------


def _random_eagle3_head(target, seed: int = 0):
    """A random EAGLE-3 head on the inputs of layers 0 and 1 and the last output: a Llama layer
    whatever the target. This seed gets some of its tokens accepted on the tiny target (most
    random heads of a 103-token vocabulary get none; float64 makes it deterministic)."""
    from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind

    torch.manual_seed(seed)
    cfg = EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=(0, 1, 3))
    head = EagleHeadModel(target, cfg)
    assert not head.layer_config.olmo2 and not head.layer_config.qk_norm
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return head.to(target.dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("proposer", ["plain", "draft-model", "prompt-lookup", "eagle-tree"])
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
    prompts = _prompts(5, seed=2, lengths=(6, 16))
    prompts[0] = prompts[0][:3] * 4  # repeats: prompt lookup has something to find
    assert_greedy_as_transformers(target, hf, drafts, k, prompts, NEW_TOKENS,
                                  expect_accepted=proposer in ("draft-model", "eagle-tree"))  # fmt: skip


def test_a_transformers_object_decodes_as_itself(checkpoint):
    """``Generator.from_pretrained(hf_model)``: the object's config and weights, copied."""
    _, hf = checkpoint("bias-rope-scaling")
    gen = Generator.from_pretrained(hf, dtype="float64")
    prompts = _prompts(2, seed=9)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("quantization", [None, "int8", "q4"], ids=["bf16", "int8", "q4"])
def test_speculation_equals_plain_through_the_cpu_kernels(checkpoint, kernel, quantization):
    """bf16 (packed), int8 and q4 targets and drafts on the CPU backend: each row is computed
    alone, so a speculative run emits exactly the same model's plain tokens."""
    path, hf = checkpoint()
    draft_path, _ = checkpoint("base", "draft")
    target, _, _ = load_model(path, quantization=quantization)
    layer = target.layers[0]
    if quantization is not None:
        cls = Int8Linear if quantization == "int8" else Q4Linear
        assert isinstance(layer.self_attn.qkv_proj, cls) and isinstance(layer.mlp.down_proj, cls)
    hf_layer = hf.model.layers[0]
    for name in ("self_attn.q_norm", "self_attn.k_norm", "post_feedforward_layernorm"):
        norm = layer.get_submodule(name).weight
        assert norm.dtype == torch.bfloat16  # the norms stay as they were
        torch.testing.assert_close(norm, hf_layer.get_submodule(name).weight.to(torch.bfloat16), rtol=0, atol=0)
    prompts = _prompts(4, seed=5, lengths=(6, 16))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = Generator.from_components(target).generate(prompts, params)
    draft = DraftModel.from_pretrained(draft_path, quantization=quantization, num_speculative_tokens=3)
    spec = Generator.from_components(target, proposer=draft, policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.metrics.num_accepted > 0


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("layer_types", dict(layer_types=["sliding_attention"] * 3, sliding_window=4)),
        ("rope_parameters.rope_type", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4))),
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
        setattr(cfg, name, value)
    cfg.architectures = ["Olmo2ForCausalLM"]
    with pytest.raises(ValueError, match=rf"config field {field}=.*\(supported: "):
        ModelConfig.from_hf_config(cfg)


def test_tensor_parallel_and_mtp_heads_are_refused(checkpoint):
    from specdec.distributed.sharding import check_shardable
    from specdec.models.mtp_head import MTPModule, MTPModuleConfig

    target, _, _ = load_model(checkpoint()[0], dtype="float64")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*olmo2 \(OLMo 2\)"):
        check_shardable(target.config, 2)
    check_shardable(target.config, 1)
    with pytest.raises(ValueError, match=r"MTP heads are not implemented for olmo2 targets \(OLMo 2\)"):
        MTPModule(target, MTPModuleConfig.for_target(target.config))


# --- GGUF files as llama.cpp writes OLMo 2 (the gguf package) -----------------------------------

_GGUF_BLOCK = {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str) -> str:
    import re

    module, leaf = hf_name.rsplit(".", 1)
    if module in _GGUF_TOP:
        return f"{_GGUF_TOP[module]}.{leaf}"
    layer, inner = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module).groups()
    return f"blk.{layer}.{_GGUF_BLOCK[inner]}.{leaf}"


def write_olmo2_gguf(path, model, qtype) -> None:
    """``model`` (float32) as llama.cpp's convert_hf_to_gguf.py writes OLMo 2 (``Olmo2Model``):
    its tensor names, q/k rows as they are (no permutation: its RoPE is NeoX's), norms as they
    are, 1-D tensors F32, ``output.weight`` (untied)."""
    import gguf

    cfg = model.config
    writer = gguf_writer(path, "olmo2", cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "f32" else gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensor_type = gguf.GGMLQuantizationType.F32 if qtype == "f32" else gguf.GGMLQuantizationType.Q4_0
    for name, tensor in model.state_dict().items():
        data = tensor.numpy()
        if data.ndim == 1 or tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), data.astype("float32"))
        else:
            blocks = gguf.quants.quantize(data, tensor_type)
            writer.add_tensor(_gguf_name(name), blocks, raw_shape=blocks.shape, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """"f32" | "q4_0" -> (GGUF file, its float32 transformers source model)."""
    pytest.importorskip("gguf")
    cache: dict[str, tuple] = {}

    def build(qtype: str):
        if qtype not in cache:
            source = make_olmo2(seed=3, dtype=torch.float32)
            path = tmp_path_factory.mktemp("gguf-olmo2") / f"tiny-olmo2-{qtype}.gguf"
            write_olmo2_gguf(path, source, qtype)
            cache[qtype] = (path, source)
        return cache[qtype]

    return build


def test_gguf_loads_as_its_source(gguf_files):
    """The file's config is its source's and its logits are the source's through specdec, and
    transformers' (transformers itself reads no olmo2 file)."""
    path, source = gguf_files("f32")
    model, _, _ = load_model(path, dtype="float32")
    want = ModelConfig.from_hf_config(source.config)
    assert model.config.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # float32 in the file
    # the file has no EOS key here: Olmo2Config's default fills it
    assert attrs.evolve(model.config, rms_norm_eps=want.rms_norm_eps, eos_token_ids=()) == want
    prompts = _prompts(3, seed=4)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts)):
        torch.testing.assert_close(logits, hf_logits(source, p, torch.float32), rtol=1e-4, atol=1e-4)


def test_gguf_q4_keeps_the_files_codes_and_norms(gguf_files, kernel):
    """``quantization="q4"`` of a Q4_0 file, read tensor by tensor: its norms are the dense
    load's bit for bit, and its logits are the dense load's within the int8 activations' noise."""
    path, _ = gguf_files("q4_0")
    q4, _, _ = load_model(path, quantization="q4")
    dense, _, _ = load_model(path, dtype="bfloat16", pack=False)
    assert isinstance(q4.layers[0].self_attn.qkv_proj, Q4Linear) and isinstance(q4.lm_head, Q4Linear)
    norms = {n: t for n, t in dense.state_dict().items() if n.endswith("norm.weight")}
    assert len(norms) == 3 * 4 + 1
    q4_state = q4.state_dict()
    assert all(torch.equal(q4_state[n], t) for n, t in norms.items())
    prompts = _prompts(3, seed=6)
    for a, b in zip(_cpu_prefill_logits(q4, prompts), _cpu_prefill_logits(dense, prompts)):
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.99
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Generator.from_components(q4).generate(prompts, params)
    spec = Generator.from_components(q4, proposer=DraftModel.from_model(dense), policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]


@pytest.mark.parametrize(
    "key, value", [("attention.sliding_window", 4096), ("rope.scaling.type", "yarn")]
)
def test_gguf_olmo3_and_rope_scaled_files_are_refused(tmp_path, key, value):
    """llama.cpp writes OLMo 3 (sliding-window layers) as "olmo2" too, and OLMo 2's YaRN scaling
    as keys this reader does not map: refused, naming the key."""
    pytest.importorskip("gguf")
    from specdec.models.gguf_file import GgufFile

    file = GgufFile(tmp_path / "olmo3.gguf", {"general.architecture": "olmo2", f"olmo2.{key}": value}, {})
    with pytest.raises(ValueError, match=rf"olmo3.gguf: GGUF key olmo2.{key}={value!r} is not supported"):
        file.config_dict()
