"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers, the reference.

Tiny random checkpoints written by transformers' ``save_pretrained`` (four layers, sliding and
global interleaved, a window of 5 tokens that every prompt outgrows; Gemma 2's attention scores
capped at 2 and both families' logits at 5, low enough to change them; Gemma 3 with a sliding
RoPE base of its own and linear RoPE scaling on its global layers) are loaded through specdec's
loaders and compared with transformers' own model of the same files (eager attention):

- float64 logits of a ragged prefill; bf16 logits (packed linears, the CPU attention kernel for
  Gemma 3, the float64 reference attention for Gemma 2's capped scores) within bf16 noise, and
  neither of the CPU kernels' fused paths (Llama's norms and SiLU) is ever taken;
- greedy decoding equal to ``generate``: plain, with a Gemma draft model, prompt lookup and an
  EAGLE tree (the head is a Llama layer on the Gemma target's hidden states);
- bf16, int8 and q4 targets and drafts: speculative output equals the same model's plain output;
- negative controls: the same weights with one Gemma difference dropped (norms times ``w``
  instead of ``1 + w``, no embedding scale, no soft caps, windows ignored, Gemma 3's sliding
  RoPE ignored, Llama's attention scale) disagree with transformers far beyond the tolerance;
- configs specdec cannot honour are refused, naming the field.
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
from specdec.models import gemma, llama
from specdec.models.llama import Architecture, ModelConfig, rms_norm
from specdec.models.loading import load_model, model_from_state_dict
from specdec.models.quantized import Int8Linear, Q4Linear
from specdec.proposers import DraftModel, EAGLETree, PromptLookup

F64 = torch.float64
HF_TOL = dict(rtol=1e-5, atol=2e-5)  # transformers runs Gemma's RMSNorm and RoPE in float32
BF16_TOL = 0.05  # max |bf16 logits - reference| over the reference's range (~0.01 seen)
NEW_TOKENS = 20
WINDOW = 5
SLIDING, FULL = "sliding_attention", "full_attention"
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    query_pre_attn_scalar=20,  # not head_dim: the scale must come from here
    vocab_size=103,
    max_position_embeddings=256,
    sliding_window=WINDOW,
    attn_implementation="eager",
)
FAMILIES = {
    # layer_types default: sliding, full, sliding, full
    "gemma2": dict(attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    "gemma3": dict(
        layer_types=[SLIDING, SLIDING, FULL, SLIDING],
        final_logit_softcapping=5.0,
        rope_local_base_freq=100.0,
        rope_scaling=dict(rope_type="linear", factor=4.0),
    ),
}


def _hf_config(family: str, **overrides):
    from transformers import Gemma2Config, Gemma3TextConfig

    cls = Gemma2Config if family == "gemma2" else Gemma3TextConfig
    return cls(**{**TINY, **FAMILIES[family], **overrides})


def make_gemma(family: str, seed: int = 0, *, draft_of=None):
    """A random float64 transformers Gemma of the tiny config, norm weights far from 0 (so that
    ``1 + w`` matters); ``draft_of``: that model's weights plus noise (a draft that agrees often)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(family), dtype=F64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if draft_of is not None:
                p.copy_(draft_of.get_parameter(name) + 0.03 * torch.randn_like(p))
            else:
                p.copy_((0.5 if name.endswith("norm.weight") else 0.2) * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(family, role) -> (directory saved by transformers, its model); role "draft" is a noisy
    copy of the target."""
    def make(family: str, draft_of=None):
        return make_gemma(family, seed=7 if draft_of is not None else 0, draft_of=draft_of)

    return saved_checkpoints(tmp_path_factory, make)


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (8, 21)) -> list[list[int]]:
    return random_prompts(TINY["vocab_size"], n, seed, max_len=lengths[1], min_len=lengths[0])


_cpu_prefill_logits = cpu_prefill_logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_reads_gemma(checkpoint, family):
    _, hf = checkpoint(family)
    cfg = ModelConfig.from_hf_config(hf.config)
    g = cfg.gemma
    assert cfg.architecture is (Architecture.GEMMA2 if family == "gemma2" else Architecture.GEMMA3)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    assert cfg.qk_norm is (family == "gemma3") and cfg.sliding_window is None
    types = hf.config.layer_types
    assert g.layer_windows == tuple(WINDOW if t == SLIDING else None for t in types)
    assert cfg.attention_spec.layer_windows == g.layer_windows
    assert cfg.attention_spec.sm_scale == 20**-0.5 and g.embed_scale == 8.0
    assert g.final_logit_softcap == 5.0
    assert g.attn_logit_softcap == (2.0 if family == "gemma2" else None)  # Gemma 3 passes none
    rotary = hf.model.rotary_emb
    exact = dict(rtol=0, atol=0)
    if family == "gemma2":
        torch.testing.assert_close(torch.tensor(cfg.inv_freq), rotary.inv_freq, **exact)
        assert g.sliding_inv_freq is None
    else:
        torch.testing.assert_close(torch.tensor(cfg.inv_freq), rotary.full_attention_inv_freq, **exact)
        torch.testing.assert_close(
            torch.tensor(g.sliding_inv_freq), rotary.sliding_attention_inv_freq, **exact
        )
        assert cfg.inv_freq != g.sliding_inv_freq  # linear scaling and another base


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_float64(checkpoint, family):
    path, hf = checkpoint(family)
    model, _, _ = load_model(path, dtype="float64")
    assert isinstance(model.layers[0], gemma.GemmaDecoderLayer)
    prompts = _prompts(4, seed=1)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4)):
        torch.testing.assert_close(logits, hf_logits(hf, p), **HF_TOL)


def _without(traits_change: dict):
    return lambda cfg: attrs.evolve(cfg, gemma=attrs.evolve(cfg.gemma, **traits_change))


# Each drops one Gemma difference; all must disagree with transformers.
NEGATIVE_CONTROLS = {
    "norm-times-w": None,  # Llama's RMSNorm (times w) for every Gemma norm: monkeypatched
    "no-embedding-scale": _without(dict(embed_scale=1.0)),
    "no-final-soft-cap": _without(dict(final_logit_softcap=None)),
    "windows-ignored": _without(dict(sliding_window=None)),
    "llama-attention-scale": _without(dict(query_pre_attn_scalar=24.0)),  # head_dim ** -0.5
    "no-attention-soft-cap": _without(dict(attn_logit_softcap=None)),  # Gemma 2 only
    "no-sliding-rope": _without(dict(sliding_inv_freq=None)),  # Gemma 3 only
}


ONE_FAMILY = {"no-attention-soft-cap": "gemma2", "no-sliding-rope": "gemma3"}


@pytest.mark.parametrize(
    "family, control",
    [(f, c) for f in FAMILIES for c in NEGATIVE_CONTROLS if ONE_FAMILY.get(c, f) == f],
)
def test_negative_controls_disagree(checkpoint, monkeypatch, family, control):
    _, hf = checkpoint(family)
    cfg = ModelConfig.from_hf_config(hf.config)
    change = NEGATIVE_CONTROLS[control]
    if change is None:
        monkeypatch.setattr(gemma, "gemma_rms_norm", rms_norm)
    else:
        cfg = change(cfg)
    model = model_from_state_dict(cfg, iter(hf.state_dict().items()), dtype=F64, device=torch.device("cpu"))
    prompts = _prompts(4, seed=1)
    errors = [
        float((logits - hf_logits(hf, p)).abs().max())
        for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4))
    ]
    assert max(errors) > 0.1, errors  # the tolerance above is 2e-5; 0.25-7.4 seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_bf16_through_gemmas_fused_path(checkpoint, kernel, monkeypatch, family):
    """Packed bf16 linears and the CPU backend (its kernel for Gemma 3; the float64 reference
    for Gemma 2's capped scores) through Gemma's own fused paths (its norms and gelu): every
    layer in one kernel call for Gemma 3 (:func:`specdec.models.gemma.stack_layer_states`),
    bit for bit the per-layer loop of fused ops (:func:`~specdec.models.gemma.fused_layer_states`),
    which Gemma 2 takes. Llama's fused per-layer ops and the whole-stack kernel compute Llama's
    norms and SiLU and are never entered. The fused paths equal the layers' own modules within
    bf16 noise."""
    from specdec.models import cpu_decoder, gemma

    def forbidden(*args, **kwargs):
        raise AssertionError("a Llama fused CPU path ran a Gemma layer")

    monkeypatch.setattr(cpu_decoder, "run_stack", forbidden)
    monkeypatch.setattr(llama.LlamaModel, "_fused_layer_states", forbidden)
    calls = []
    fused, stack = gemma.fused_layer_states, gemma.stack_layer_states
    monkeypatch.setattr(gemma, "fused_layer_states", lambda *a: calls.append("loop") or fused(*a))

    def stacked(*args):
        out = stack(*args)
        calls.append("stack" if out is not None else "no stack")
        return out

    monkeypatch.setattr(gemma, "stack_layer_states", stacked)
    path, hf = checkpoint(family)
    model, _, _ = load_model(path, dtype="bfloat16")  # packed
    prompts = _prompts(4, seed=3)
    ref = bf16_reference(hf)
    ours = _cpu_prefill_logits(model, prompts)
    assert calls == (["stack"] if family == "gemma3" else ["no stack", "loop"])
    monkeypatch.setenv("SPECDEC_DISABLE_CPU_DECODER", "1")
    calls.clear()
    assert all(map(torch.equal, ours, _cpu_prefill_logits(model, prompts)))
    assert calls == ["no stack", "loop"]
    monkeypatch.delenv("SPECDEC_DISABLE_CPU_DECODER")
    errors = [bf16_error(o, hf_logits(ref, p, torch.float32)) for p, o in zip(prompts, ours)]
    assert max(errors) < BF16_TOL, errors
    reference_attention = ragged_prefill_logits(model, prompts)  # the torch backend
    for a, b in zip(ours, reference_attention):
        assert bf16_error(a, b) < 0.02
    monkeypatch.setattr(llama, "_fused_ops", lambda embeds: None)  # the layers' own modules
    for a, b in zip(ours, _cpu_prefill_logits(model, prompts)):
        assert bf16_error(a, b) < 0.02


def _random_eagle3_head(target, seed: int = 2):
    """A random EAGLE-3 head on the inputs of layers 0 and 2 and the last output (one sliding
    layer's, one global layer's, the stack's): a Llama layer whatever the target. Seed 2 gets
    some of its tokens accepted on both tiny targets (most random heads of a 103-token
    vocabulary get none; float64 makes it deterministic), so accepted tree paths are compacted."""
    from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind

    torch.manual_seed(seed)
    cfg = EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=(0, 2, 4))
    head = EagleHeadModel(target, cfg)
    assert head.layer_config.gemma is None and not head.layer_config.qk_norm
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return head.to(target.dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("proposer", ["plain", "draft-model", "prompt-lookup", "eagle-tree"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(checkpoint, family, proposer):
    path, hf = checkpoint(family)
    target, _, _ = load_model(path, dtype="float64")
    k, drafts = 3, None
    if proposer == "draft-model":
        draft_path, _ = checkpoint(family, "draft")
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_transformers_object_decodes_as_itself(checkpoint, family):
    """``Generator.from_pretrained(hf_model)``: the object's config and weights, copied."""
    _, hf = checkpoint(family)
    gen = Generator.from_pretrained(hf, dtype="float64")
    prompts = _prompts(2, seed=9)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("quantization", [None, "int8", "q4"], ids=["bf16", "int8", "q4"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculation_equals_plain_through_the_cpu_kernels(checkpoint, kernel, family, quantization):
    """bf16 (packed), int8 and q4 targets and drafts on the CPU backend: each row is computed
    alone, so a speculative run emits exactly the same model's plain tokens."""
    path, hf = checkpoint(family)
    draft_path, _ = checkpoint(family, "draft")
    target, _, _ = load_model(path, quantization=quantization)
    attn = target.layers[0].self_attn
    if quantization is not None:
        cls = Int8Linear if quantization == "int8" else Q4Linear
        assert isinstance(attn.qkv_proj, cls) and isinstance(target.layers[0].mlp.down_proj, cls)
    norm = target.layers[0].post_feedforward_layernorm.weight
    assert norm.dtype == torch.bfloat16  # the norms stay as they were
    torch.testing.assert_close(
        norm, hf.model.layers[0].post_feedforward_layernorm.weight.to(torch.bfloat16), rtol=0, atol=0
    )
    prompts = _prompts(4, seed=5, lengths=(6, 16))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = Generator.from_components(target).generate(prompts, params)
    draft = DraftModel.from_pretrained(draft_path, quantization=quantization, num_speculative_tokens=3)
    spec = Generator.from_components(target, proposer=draft, policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.metrics.num_accepted > 0


def _refused(family: str, field: str, **overrides) -> None:
    """The config with ``overrides`` set after construction (as in a config.json that
    transformers' own validation would not have let through) is refused, naming ``field``."""
    cfg = _hf_config(family)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    cfg.architectures = ["Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM"]
    with pytest.raises(ValueError, match=rf"config field {field}=.*\(supported: "):
        ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize(
    "family, field, overrides",
    [
        ("gemma3", "use_bidirectional_attention", dict(use_bidirectional_attention=True)),
        ("gemma2", "attn_logit_softcapping", dict(attn_logit_softcapping=0.0)),
        ("gemma3", "final_logit_softcapping", dict(final_logit_softcapping=-30.0)),
        ("gemma2", "query_pre_attn_scalar", dict(query_pre_attn_scalar=0)),
        ("gemma2", "hidden_activation", dict(hidden_activation="prelu")),
        ("gemma2", "layer_types", dict(layer_types=[SLIDING, FULL])),  # 2 entries, 4 layers
        ("gemma3", "layer_types", dict(layer_types=[SLIDING, FULL, "chunked_attention", FULL])),
        ("gemma2", "sliding_window", dict(sliding_window=0)),
        ("gemma3", "rope_parameters.rope_type", dict(rope_parameters={
            SLIDING: dict(rope_type="longrope", rope_theta=100.0), FULL: dict(rope_type="default", rope_theta=1e6),
        })),  # fmt: skip
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_configs_specdec_cannot_honour_are_refused(family, field, overrides):
    _refused(family, field, **overrides)


def test_multimodal_gemma3_tensor_parallel_and_mtp_heads_are_refused(checkpoint):
    from transformers import Gemma3Config

    with pytest.raises(ValueError, match="unsupported architecture.*Gemma3ForCausalLM"):
        ModelConfig.from_hf_config(Gemma3Config(architectures=["Gemma3ForConditionalGeneration"]))
    from specdec.distributed.sharding import check_shardable

    target, _, _ = load_model(checkpoint("gemma2")[0], dtype="float64")
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*Gemma"):
        check_shardable(target.config, 2)
    from specdec.models.mtp_head import MTPModule, MTPModuleConfig

    with pytest.raises(ValueError, match="MTP heads are not implemented for gemma2"):
        MTPModule(target, MTPModuleConfig.for_target(target.config))


# --- GGUF files as llama.cpp writes Gemma (the gguf package) -----------------------------------

# A GGUF file has no key for the attention scale (llama.cpp: 1/sqrt(head_dim) but for the 27B
# models) nor for Gemma 3's sliding RoPE base (10000) or its final soft cap (none): the source
# models of the files have those values; everything else the file says.
GGUF_SOURCE = {
    "gemma2": dict(query_pre_attn_scalar=24),
    "gemma3": dict(
        query_pre_attn_scalar=24, final_logit_softcapping=None, rope_local_base_freq=10000.0
    ),
}
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
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
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}


def _gguf_name(hf_name: str) -> str:
    import re

    module, leaf = hf_name.rsplit(".", 1)
    if module in _GGUF_TOP:
        return f"{_GGUF_TOP[module]}.{leaf}"
    layer, inner = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module).groups()
    return f"blk.{layer}.{_GGUF_BLOCK[inner]}.{leaf}"


def write_gemma_gguf(path, model, qtype) -> None:
    """``model`` (float32) as llama.cpp's convert_hf_to_gguf.py writes Gemma 2 / Gemma 3: its
    tensor names, norm weights stored as ``1 + w``, 1-D tensors F32, no ``output.weight``
    (tied), the soft caps (Gemma 2), Gemma 3's linear RoPE scaling and its layers' pattern."""
    import gguf

    cfg = model.config
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    writer = gguf_writer(path, arch, cfg, head_dim=True)
    writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters[FULL]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window_pattern([t == SLIDING for t in cfg.layer_types])
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "f32" else gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensor_type = gguf.GGMLQuantizationType.F32 if qtype == "f32" else gguf.GGMLQuantizationType.Q4_0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        data = tensor.numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
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
    """(family, "f32" | "q4_0") -> (GGUF file, its float32 transformers source model)."""
    pytest.importorskip("gguf")
    cache: dict[tuple[str, str], tuple] = {}

    def build(family: str, qtype: str):
        if (family, qtype) not in cache:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(3)
            cfg = _hf_config(family, **GGUF_SOURCE[family])
            source = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
            with torch.no_grad():
                for name, p in source.named_parameters():
                    p.copy_((0.5 if name.endswith("norm.weight") else 0.2) * torch.randn_like(p))
            path = tmp_path_factory.mktemp(f"gguf-{family}") / f"tiny-{family}-{qtype}.gguf"
            write_gemma_gguf(path, source, qtype)
            cache[family, qtype] = (path, source)
        return cache[family, qtype]

    return build


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_loads_as_its_source(gguf_files, family):
    """The file's config is its source's (every Gemma field the file holds or implies) and its
    logits are the source's through specdec, and transformers' (its norms back from 1 + w)."""
    path, source = gguf_files(family, "f32")
    model, hf_config, _ = load_model(path, dtype="float32")
    want = ModelConfig.from_hf_config(source.config)
    assert model.config.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # float32 in the file
    assert attrs.evolve(model.config, rms_norm_eps=want.rms_norm_eps, eos_token_ids=()) == attrs.evolve(
        want, eos_token_ids=()
    )
    prompts = _prompts(3, seed=4)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts)):
        torch.testing.assert_close(logits, hf_logits(source, p, torch.float32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_q4_keeps_the_files_codes_and_gemmas_norms(gguf_files, kernel, family):
    """``quantization="q4"`` of a Q4_0 file, read tensor by tensor: its norms are the dense
    load's bit for bit (shifted back from 1 + w), and its logits are the dense load's within
    the int8 activations' noise."""
    path, _ = gguf_files(family, "q4_0")
    q4, _, _ = load_model(path, quantization="q4")
    dense, _, _ = load_model(path, dtype="bfloat16", pack=False)
    assert isinstance(q4.layers[0].self_attn.qkv_proj, Q4Linear)
    norms = {n: t for n, t in dense.state_dict().items() if n.endswith("norm.weight")}
    assert len(norms) == 4 * 4 + 1 + (8 if family == "gemma3" else 0)
    q4_state = q4.state_dict()
    assert all(torch.equal(q4_state[n], t) for n, t in norms.items())
    prompts = _prompts(3, seed=6)
    for a, b in zip(_cpu_prefill_logits(q4, prompts), _cpu_prefill_logits(dense, prompts)):
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.99
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Generator.from_components(q4).generate(prompts, params)
    spec = Generator.from_components(q4, proposer=DraftModel.from_model(dense), policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
