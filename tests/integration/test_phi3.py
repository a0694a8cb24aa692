"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``) against Hugging Face transformers, the reference.

Tiny random checkpoints written by transformers' ``save_pretrained``: "phi3" as Phi-3-mini-4k
(RoPE over whole heads, a window of 5 tokens that every prompt outgrows, an untied LM head) and
"phi4mini" as Phi-4-mini (``partial_rotary_factor=0.75``: 12 of 16 channels a head rotate;
longrope with distinct short and long factors, ``original_max_position_embeddings=48`` of 256;
tied embeddings). Both are loaded through specdec's loaders and compared with transformers'
own model of the same files (eager attention):

- float64 logits of a ragged prefill; bf16 logits through the CPU kernels' fused paths (the
  whole-stack kernel, the per-layer fused ops: partial RoPE is a channel order of the q/k rows,
  see ``specdec.models.phi3``) within bf16 noise;
- greedy decoding equal to ``generate``: plain, with a Phi-3 draft model, prompt lookup, an
  EAGLE tree and an MTP head;
- bf16, int8 and q4 targets and drafts: speculative output equals the same model's plain output;
- longrope: transformers rotates every position with the long factors once a sequence passes
  ``original_max_position_embeddings``; specdec runs the short factors up to that length,
  exactly (greedy to the last token it allows), and refuses longer requests naming the field;
- negative controls: k and v swapped, gate and up swapped, every channel rotated, the channels
  left in transformers' order, the passed channels scaled, long factors used too early, no
  attention factor, the window ignored: each disagrees with transformers far beyond tolerance;
- configs specdec cannot honour, and tensor parallelism, are refused naming the field;
- GGUF files as llama.cpp writes ``phi3`` (fused ``attn_qkv``, ``ffn_up`` holding gate and up,
  the longrope factor tensors): dense F32 and Q4_0 read as q4.
"""

from __future__ import annotations

import re

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
    saved_checkpoints,
)

from specdec import CacheConfig, Generator, SamplingParams
from specdec.models import config_checks, llama, phi3
from specdec.models.llama import Architecture, ModelConfig
from specdec.models.loading import load_model, model_from_state_dict
from specdec.models.quantized import Int8Linear, Q4Linear
from specdec.proposers import DraftModel, EAGLETree, MTPHead, PromptLookup

F64 = torch.float64
HF_TOL = dict(rtol=1e-5, atol=2e-5)  # transformers computes RoPE in float32
BF16_TOL = 0.05  # max |bf16 logits - reference| over the reference's range
NEW_TOKENS = 20
WINDOW = 5
ORIGINAL = 48  # phi4mini's original_max_position_embeddings: the context specdec runs it at
SHORT = [1.0, 1.25, 1.8, 2.6, 3.5, 5.0]  # one per rotated pair: 12 channels / 2
LONG = [1.5, 2.7, 4.9, 8.0, 13.0, 21.0]
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # head_dim 16
    vocab_size=103,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
)
FAMILIES = {
    "phi3": dict(sliding_window=WINDOW),
    "phi4mini": dict(
        partial_rotary_factor=0.75,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG),
        tie_word_embeddings=True,
    ),
}


def _hf_config(family: str, **overrides):
    from transformers import Phi3Config

    return Phi3Config(**{**TINY, **FAMILIES[family], **overrides})


def make_phi3(family: str, seed: int = 0, *, draft_of=None, dtype=F64):
    """A random transformers Phi-3 of the tiny config, norm weights far from 1; ``draft_of``:
    that model's weights plus noise (a draft that agrees often)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(family), dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if draft_of is not None:
                p.copy_(draft_of.get_parameter(name) + 0.03 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(family, role) -> (directory saved by transformers, its model); role "draft" is a noisy
    copy of the target."""
    def make(family: str, draft_of=None):
        return make_phi3(family, seed=7 if draft_of is not None else 0, draft_of=draft_of)

    return saved_checkpoints(tmp_path_factory, make)


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (8, 21)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(*lengths, (n,), generator=g).tolist()
    return [torch.randint(3, TINY["vocab_size"], (s,), generator=g).tolist() for s in sizes]


_cpu_prefill_logits = cpu_prefill_logits


def _long_inv_freq(hf_config, head_dim: int = 16) -> tuple[float, ...]:
    """longrope's long-factor frequencies, as transformers computes them past the original
    length, padded as specdec lays them out."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=ORIGINAL + 1)
    return tuple(long.tolist()) + (0.0,) * (head_dim // 2 - long.numel())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_reads_phi3(checkpoint, family):
    _, hf = checkpoint(family)
    cfg = ModelConfig.from_hf_config(hf.config)
    rotary = hf.model.rotary_emb
    assert cfg.architecture is Architecture.PHI3 and cfg.head_dim == 16
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, False)
    inv_freq = torch.tensor(cfg.inv_freq)
    pairs = rotary.inv_freq.numel()  # transformers' rotated pairs
    torch.testing.assert_close(inv_freq[:pairs], rotary.inv_freq, rtol=0, atol=0)
    assert cfg.rope_attention_scaling == rotary.attention_scaling
    if family == "phi3":
        assert pairs == 8 and cfg.phi3.rotary_dim == 16 and cfg.sliding_window == WINDOW
        assert cfg.max_position_embeddings == 256 and cfg.context_field == "max_position_embeddings"
        assert not cfg.tie_word_embeddings
    else:
        assert pairs == 6 and cfg.phi3.rotary_dim == 12 and inv_freq[6:].eq(0).all()
        assert cfg.rope_attention_scaling == pytest.approx(
            1.19684, abs=1e-5
        )  # sqrt(1 + ln(256/48) / ln 48)
        assert (
            cfg.max_position_embeddings == ORIGINAL
            and "original_max_position_embeddings" in cfg.context_field
        )
        assert cfg.sliding_window is None and cfg.tie_word_embeddings


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_float64(checkpoint, family):
    path, hf = checkpoint(family)
    model, _, _ = load_model(path, dtype="float64")
    prompts = _prompts(4, seed=1)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts)):
        torch.testing.assert_close(logits, hf_logits(hf, p), **HF_TOL)


def _swap_rows(name_end: str, first: slice, second: slice):
    """A checkpoint reader that swaps two row blocks of the tensors named ``*name_end``."""

    def change(name: str, t: torch.Tensor) -> torch.Tensor:
        if not name.endswith(name_end):
            return t
        t = t.clone()
        t[first], t[second] = t[second].clone(), t[first].clone()
        return t

    return change


def _evolve(**changes):
    return lambda cfg, hf_config: attrs.evolve(cfg, **changes)


# Each is a plausible bug; all must disagree with transformers. (checkpoint tensor change or
# None, config change or None, monkeypatch of specdec.models.phi3 or None, the family.)
NEGATIVE_CONTROLS = {
    "k-and-v-swapped": (
        _swap_rows("qkv_proj.weight", slice(64, 96), slice(96, 128)),
        None,
        None,
        "phi4mini",
    ),
    "gate-and-up-swapped": (
        _swap_rows("gate_up_proj.weight", slice(0, 96), slice(96, 192)),
        None,
        None,
        "phi3",
    ),
    "every-channel-rotated": (
        None,
        lambda cfg, hf_config: attrs.evolve(
            cfg,
            inv_freq=tuple(config_checks.default_inv_freq(10000.0, 16).tolist()),
            phi3=attrs.evolve(cfg.phi3, rotary_dim=16),
        ),
        None,
        "phi4mini",
    ),
    "channels-in-transformers-order": (None, None, ("qkv_row_order", lambda *a: None), "phi4mini"),
    "passed-channels-scaled": (
        None,
        None,
        ("pair_scaling", lambda cfg, device=None: torch.zeros(0)),
        "phi4mini",
    ),
    "long-factors-too-early": (
        None,
        lambda cfg, hf_config: attrs.evolve(cfg, inv_freq=_long_inv_freq(hf_config)),
        None,
        "phi4mini",
    ),
    "no-attention-factor": (None, _evolve(rope_attention_scaling=1.0), None, "phi4mini"),
    "window-ignored": (None, _evolve(sliding_window=None), None, "phi3"),
}


@pytest.mark.parametrize("control", list(NEGATIVE_CONTROLS))
def test_negative_controls_disagree(checkpoint, monkeypatch, control):
    tensors, config, patch, family = NEGATIVE_CONTROLS[control]
    _, hf = checkpoint(family)
    cfg = ModelConfig.from_hf_config(hf.config)
    if config is not None:
        cfg = config(cfg, hf.config)
    if patch is not None:
        monkeypatch.setattr(phi3, *patch)
    state = hf.state_dict().items()
    if tensors is not None:
        state = [(name, tensors(name, t)) for name, t in state]
    model = model_from_state_dict(cfg, iter(state), dtype=F64, device=torch.device("cpu"))
    prompts = _prompts(4, seed=1)
    errors = [
        float((logits - hf_logits(hf, p)).abs().max())
        for p, logits in zip(prompts, ragged_prefill_logits(model, prompts))
    ]
    assert max(errors) > 0.1, errors  # the tolerance above is 2e-5; 6.6-9.7 seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_bf16_through_the_fused_kernels(
    checkpoint, kernel, monkeypatch, family
):
    """Packed bf16 linears and the CPU backend through the whole-stack kernel (every layer in
    one call), through the per-layer fused ops, and through the layers' own modules: each within
    bf16 noise of transformers' (bf16 weights, float32 arithmetic)."""
    from specdec.models import cpu_decoder

    path, hf = checkpoint(family)
    model, _, _ = load_model(path, dtype="bfloat16")  # packed
    prompts = _prompts(4, seed=3)
    ref = [hf_logits(bf16_reference(hf), p, torch.float32) for p in prompts]
    calls: list[str] = []

    def spy(owner, name: str) -> None:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(name) or real(*a, **k))

    spy(cpu_decoder, "run_stack")
    spy(llama.LlamaModel, "_fused_layer_states")
    paths = {"whole-stack kernel": _cpu_prefill_logits(model, prompts)}
    monkeypatch.setattr(cpu_decoder, "applies", lambda *a: False)
    paths["fused per-layer ops"] = _cpu_prefill_logits(model, prompts)
    monkeypatch.setattr(llama, "_fused_ops", lambda embeds: None)
    paths["modules"] = _cpu_prefill_logits(model, prompts)
    # partial RoPE and longrope did not send Phi-3 off the fused paths
    assert calls == ["run_stack", "_fused_layer_states"]
    for where, ours in paths.items():
        errors = [bf16_error(o, r) for o, r in zip(ours, ref)]
        assert max(errors) < BF16_TOL, (where, errors)


def _random_eagle3_head(target, seed: int = 2):
    """A random EAGLE-3 head on the inputs of layers 0 and 2 and the last output: a Llama layer
    with the target's RoPE tables. Seed 2 gets some tokens accepted (float64: deterministic)."""
    from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind

    torch.manual_seed(seed)
    cfg = EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=(0, 2, 3))
    head = EagleHeadModel(target, cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return head.to(target.dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("proposer", ["plain", "draft-model", "prompt-lookup", "eagle-tree", "mtp"])
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
    elif proposer == "mtp":  # the head's layer is a Phi-3 layer: the target's RoPE tables
        drafts = MTPHead.from_model(random_head(target, 1))
        k = drafts.num_speculative_tokens
    prompts = _prompts(5, seed=2, lengths=(6, 16))
    prompts[0] = prompts[0][:3] * 4  # repeats: prompt lookup has something to find
    assert_greedy_as_transformers(target, hf, drafts, k, prompts, NEW_TOKENS,
                                  expect_accepted=proposer in ("draft-model", "eagle-tree"))  # fmt: skip


def test_a_transformers_object_decodes_as_itself(checkpoint):
    """``Generator.from_pretrained(hf_model)``: the object's config and weights, copied."""
    _, hf = checkpoint("phi4mini")
    gen = Generator.from_pretrained(hf, dtype="float64")
    prompts = _prompts(2, seed=9)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize(
    "family, quantization",
    [("phi3", None), ("phi4mini", None), ("phi4mini", "int8"), ("phi4mini", "q4"), ("phi3", "q4")],
    ids=lambda v: v or "bf16",
)
def test_speculation_equals_plain_through_the_cpu_kernels(checkpoint, kernel, family, quantization):
    """bf16 (packed), int8 and q4 targets and drafts on the CPU backend: each row is computed
    alone, so a speculative run emits exactly the same model's plain tokens."""
    path, hf = checkpoint(family)
    draft_path, _ = checkpoint(family, "draft")
    target, _, _ = load_model(path, quantization=quantization)
    if quantization is not None:
        cls = Int8Linear if quantization == "int8" else Q4Linear
        assert isinstance(target.layers[0].self_attn.qkv_proj, cls)
        assert isinstance(target.layers[0].mlp.gate_up_proj, cls)
    prompts = _prompts(4, seed=5, lengths=(6, 16))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = Generator.from_components(target).generate(prompts, params)
    draft = DraftModel.from_pretrained(
        draft_path, quantization=quantization, num_speculative_tokens=3
    )
    spec = Generator.from_components(target, proposer=draft, policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.metrics.num_accepted > 0


# --- longrope: the short factors up to original_max_position_embeddings, nothing past it -------


def test_transformers_switches_every_position_to_the_long_factors_past_the_original_length(
    checkpoint,
):
    """What specdec does not implement: one token past ``original_max_position_embeddings``,
    transformers' logits change at every position but the first (the long factors rotate them
    all; position 0 is rotated by no angle), while up to it they are the short factors'
    (specdec's)."""
    path, hf = checkpoint("phi4mini")
    model, _, _ = load_model(path, dtype="float64")
    ids = _prompts(1, seed=11, lengths=(ORIGINAL + 1, ORIGINAL + 2))[0]
    at_original, past = hf_logits(hf, ids[:ORIGINAL]), hf_logits(hf, ids)
    moved = (past[:ORIGINAL] - at_original).abs().amax(-1)  # [ORIGINAL]
    assert moved[0] == 0 and float(moved[1:].min()) > 1e-3 and float(moved.max()) > 0.05, moved
    (ours,) = ragged_prefill_logits(model, [ids[:ORIGINAL]])
    torch.testing.assert_close(ours, at_original, **HF_TOL)


def test_greedy_to_the_original_length_matches_transformers(checkpoint):
    """A request that ends exactly at ``original_max_position_embeddings`` tokens, speculative
    (verify passes up to the last position), equals ``generate``."""
    path, hf = checkpoint("phi4mini")
    target, _, _ = load_model(path, dtype="float64")
    draft = DraftModel.from_pretrained(
        checkpoint("phi4mini", "draft")[0], dtype="float64", num_speculative_tokens=4
    )
    gen = Generator.from_components(target, proposer=draft, policy=4)
    prompt = _prompts(1, seed=12, lengths=(30, 31))[0]
    n = ORIGINAL - len(prompt)
    (out,) = gen.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf, prompt, n) and gen.metrics.num_accepted > 0


def test_requests_past_the_original_length_are_refused_naming_it(checkpoint):
    path, _ = checkpoint("phi4mini")
    target, _, _ = load_model(path, dtype="float64")
    gen = Generator.from_components(target)
    prompt = _prompts(1, seed=12, lengths=(30, 31))[0]
    field = re.escape("rope_parameters.original_max_position_embeddings")
    with pytest.raises(ValueError, match=rf"max_new_tokens must be at most 18 .*{field}"):
        gen.generate(
            [prompt], SamplingParams(max_new_tokens=ORIGINAL - len(prompt) + 1, ignore_eos=True)
        )
    with pytest.raises(
        ValueError, match=rf"max_model_len \(49\) exceeds the model's context \({field}.* = 48\)"
    ):
        Generator.from_components(target, cache_config=CacheConfig(max_model_len=ORIGINAL + 1))
    # without longrope (or with an original length at the context) the context is the usual one
    cfg = ModelConfig.from_hf_config(_hf_config("phi4mini", original_max_position_embeddings=256))
    assert cfg.max_position_embeddings == 256 and cfg.context_field == "max_position_embeddings"


# --- refusals ----------------------------------------------------------------------------------


def _refused(family: str, field: str, **overrides) -> None:
    """The config with ``overrides`` set after construction (as in a config.json that
    transformers' own validation would not have let through) is refused, naming ``field``."""
    cfg = _hf_config(family)
    for name, value in overrides.items():
        if name == "rope":
            cfg.rope_parameters = {**cfg.rope_parameters, **value}
        else:
            setattr(cfg, name, value)
    with pytest.raises(ValueError, match=rf"config field {re.escape(field)}=.*\(supported: "):
        ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize(
    "family, field, overrides",
    [
        ("phi3", "rope_parameters.rope_type", dict(rope=dict(rope_type="dynamic", factor=2.0))),
        ("phi4mini", "rope_parameters.rope_type", dict(rope=dict(rope_type="yarn"))),
        ("phi4mini", "rope_parameters.partial_rotary_factor", dict(rope=dict(partial_rotary_factor=0.7))),  # 11
        ("phi3", "rope_parameters.partial_rotary_factor", dict(rope=dict(partial_rotary_factor=1.5))),
        ("phi4mini", "rope_parameters.short_factor", dict(rope=dict(short_factor=[1.0] * 8))),
        ("phi4mini", "rope_parameters.long_factor", dict(rope=dict(long_factor=None))),
        ("phi4mini", "rope_parameters.original_max_position_embeddings",
         dict(rope=dict(original_max_position_embeddings=0))),
        ("phi3", "sliding_window", dict(sliding_window=0)),
        ("phi3", "hidden_act", dict(hidden_act="prelu")),
        ("phi3", "quantization_config", dict(quantization_config={"quant_method": "gptq"})),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_configs_specdec_cannot_honour_are_refused(family, field, overrides):
    _refused(family, field, **overrides)


def test_tensor_parallel_is_refused(checkpoint):
    from specdec.distributed.sharding import check_shardable

    cfg = ModelConfig.from_hf_config(checkpoint("phi3")[1].config)
    check_shardable(cfg, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*phi3.*fuse q/k/v and gate/up"):
        check_shardable(cfg, 2)


# --- GGUF files as llama.cpp writes phi3 (the gguf package) --------------------------------------

_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str) -> str:
    module, leaf = hf_name.rsplit(".", 1)
    if module in _GGUF_TOP:
        return f"{_GGUF_TOP[module]}.{leaf}"
    layer, inner = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module).groups()
    return f"blk.{layer}.{_GGUF_BLOCK[inner]}.{leaf}"


def write_phi3_gguf(path, model, qtype) -> None:
    """``model`` (float32) as llama.cpp's convert_hf_to_gguf.py (Phi3MiniModel) writes it: the
    fused tensors as they are, the rotated channels per head, the window (0: none), and for
    longrope the original length, the attention factor and the factor tensors (F32)."""
    import math

    import gguf

    cfg = model.config
    params = cfg.rope_parameters
    writer = gguf_writer(path, "phi3", cfg)
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_rope_dimension_count(
        int(params["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads
    )
    writer.add_rope_freq_base(params["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window or 0)
    tensors = {
        n: t
        for n, t in model.state_dict().items()
        if not (cfg.tie_word_embeddings and n == "lm_head.weight")
    }
    if params["rope_type"] == "longrope":
        original = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        tensors["rope_factors_long.weight"] = torch.tensor(params["long_factor"])
        tensors["rope_factors_short.weight"] = torch.tensor(params["short_factor"])
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_file_type(
        gguf.LlamaFileType.ALL_F32 if qtype == "f32" else gguf.LlamaFileType.MOSTLY_Q4_0
    )
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensor_type = (
        gguf.GGMLQuantizationType.F32 if qtype == "f32" else gguf.GGMLQuantizationType.Q4_0
    )
    for name, tensor in tensors.items():
        data = tensor.float().numpy()
        gguf_name = name if name.startswith("rope_factors") else _gguf_name(name)
        if data.ndim == 1 or tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        else:
            blocks = gguf.quants.quantize(data, tensor_type)
            writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=tensor_type)
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
            source = make_phi3(family, seed=3, dtype=torch.float32)
            path = tmp_path_factory.mktemp(f"gguf-{family}") / f"tiny-{family}-{qtype}.gguf"
            write_phi3_gguf(path, source, qtype)
            cache[family, qtype] = (path, source)
        return cache[family, qtype]

    return build


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_loads_as_its_source(gguf_files, family):
    """The file's config is its source's (partial RoPE, longrope, window) and its logits are
    transformers' of the source."""
    path, source = gguf_files(family, "f32")
    model, _, _ = load_model(path, dtype="float32")
    want = ModelConfig.from_hf_config(source.config)
    got = model.config
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # float32 in the file
    assert got.rope_attention_scaling == pytest.approx(want.rope_attention_scaling, rel=1e-7)
    same = dict(rms_norm_eps=want.rms_norm_eps, rope_attention_scaling=want.rope_attention_scaling)
    assert attrs.evolve(got, **same) == want
    prompts = _prompts(3, seed=4)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts)):
        torch.testing.assert_close(
            logits, hf_logits(source, p, torch.float32), rtol=1e-4, atol=1e-4
        )


def test_gguf_q4_keeps_the_files_codes(gguf_files, kernel):
    """``quantization="q4"`` of a Q4_0 phi3 file, read tensor by tensor: its weights are the
    file's codes in the dense load's rows (attn_qkv's q/k rows reordered for partial RoPE alike),
    its logits the dense load's within the int8 activations' noise, and speculation on it equals
    its plain output."""
    path, _ = gguf_files("phi4mini", "q4_0")
    q4, _, _ = load_model(path, quantization="q4")
    dense, _, _ = load_model(path, dtype="bfloat16", pack=False)
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ours = q4.layers[1].get_submodule(name)
        assert isinstance(ours, Q4Linear)
        want = dense.layers[1].get_submodule(name).weight.float()
        torch.testing.assert_close(ours.dequantized(), want, rtol=0, atol=4e-3)  # bf16 rounding
    prompts = _prompts(3, seed=6)
    for a, b in zip(_cpu_prefill_logits(q4, prompts), _cpu_prefill_logits(dense, prompts)):
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.97  # 0.983 seen
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Generator.from_components(q4).generate(prompts, params)
    spec = Generator.from_components(q4, proposer=DraftModel.from_model(dense), policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
