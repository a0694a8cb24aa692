"""Qwen3 (dense) against Hugging Face transformers, the reference.

Qwen3 is Qwen2's decoder plus a per-head RMSNorm of queries and keys (``self_attn.q_norm``,
``self_attn.k_norm``, over ``head_dim``, before RoPE), q/k/v/o biases only with
``attention_bias``, and a ``head_dim`` of its own (24 here, where hidden / heads is 16). Tiny
random checkpoints written by transformers' ``save_pretrained`` are loaded through specdec's
loaders and compared with transformers' own model of the same files:

- logits of a ragged prefill: float64 (the plain torch layers) and bf16 (the kernel's fused ops,
  whose q/k norm is ``llama._norm_qk``, and the whole-stack kernel's);
- greedy decoding, plain and speculative (a Qwen3 draft model), equal to ``generate``;
- int8 and q4 checkpoints (the norms stay bf16), loaded twice (the second from the disk cache);
- a sliding window on every layer, and the refusal of a window on some layers only;
- negative controls: the same model with its q/k norms skipped (plain and fused paths)
  disagrees with transformers, so the tests above would catch a dropped norm.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import (
    assert_greedy_as_transformers,
    bf16_error,
    bf16_reference,
    gguf_writer,
    hf_greedy,
    hf_logits,
    ragged_prefill_logits,
    record_drafts,
)

from specdec import CacheConfig, Generator, SamplingParams
from specdec.models import llama
from specdec.models.llama import Architecture, ModelConfig
from specdec.models.loading import load_model, model_from_state_dict
from specdec.models.quantized import Int8Linear, Q4Linear
from specdec.proposers import DraftModel, EAGLETree, PromptLookup

F64 = torch.float64
HF_TOL = dict(rtol=1e-5, atol=2e-5)  # transformers runs RMSNorm and RoPE in float32
BF16_TOL = 0.05  # max |bf16 logits - reference| over the reference's range (~0.01 seen)
NEW_TOKENS = 24
# q/k/v/o biases, and Qwen3's own RoPE base (transformers' default is 10000)
BIASED = dict(
    seed=1, attention_bias=True, rope_parameters=dict(rope_type="default", rope_theta=1e6)
)
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    vocab_size=103,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def make_qwen3(seed: int = 0, *, draft_of=None, **overrides):
    """A random float64 transformers Qwen3 of the tiny config; norms far from 1 (so that the
    q/k norms matter), biases where ``attention_bias``. ``draft_of``: start from that model's
    weights plus noise instead (a draft that agrees with it often, not always)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=F64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if draft_of is not None:
                p.copy_(draft_of.get_parameter(name) + 0.03 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Factory: (name, seed, config overrides) -> (directory saved by transformers, its model)."""
    cache: dict[str, tuple] = {}

    def build(name: str, seed: int = 0, draft_of: str | None = None, **overrides):
        if name not in cache:
            base = cache[draft_of][1] if draft_of else None
            hf = make_qwen3(seed, draft_of=base, **overrides)
            path = tmp_path_factory.mktemp(f"qwen3-{name}")
            hf.save_pretrained(path, safe_serialization=True)
            cache[name] = (path, hf)
        return cache[name]

    return build


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (1, 20)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(*lengths, (n,), generator=g).tolist()
    return [torch.randint(0, TINY["vocab_size"], (s,), generator=g).tolist() for s in sizes]


def _skip_qk_norms(model) -> None:
    """The negative control: a model that forgets Qwen3's q/k norms (plain path)."""
    for layer in model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None


def test_config_reads_qwen3(checkpoint):
    _, hf = checkpoint("base")
    cfg = ModelConfig.from_hf_config(hf.config)
    assert cfg.architecture is Architecture.QWEN3 and cfg.qk_norm
    assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_heads
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, False)
    assert cfg.sliding_window is None
    _, biased = checkpoint("bias", **BIASED)
    cfg = ModelConfig.from_hf_config(biased.config)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (True, True, False)  # the MLP has none
    torch.testing.assert_close(
        torch.tensor(cfg.inv_freq), biased.model.rotary_emb.inv_freq, rtol=0, atol=0
    )
    # Qwen3Config defaults: head_dim 128, no biases, no window unless use_sliding_window.
    from transformers import Qwen3Config

    default = ModelConfig.from_hf_config(Qwen3Config(architectures=["Qwen3ForCausalLM"]))
    assert (default.head_dim, default.qkv_bias, default.sliding_window) == (128, False, None)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("base", {}),
        ("bias", BIASED),
        ("tied", dict(seed=2, tie_word_embeddings=True)),
    ],
)
def test_logits_match_transformers_float64(checkpoint, name, overrides):
    path, hf = checkpoint(name, **overrides)
    model, _, _ = load_model(path, dtype="float64")
    assert model.layers[0].self_attn.q_norm.weight.shape == (24,)
    prompts = _prompts(5, seed=1)
    for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4)):
        torch.testing.assert_close(logits, hf_logits(hf, p), **HF_TOL)


def test_negative_control_without_qk_norm_disagrees(checkpoint):
    path, hf = checkpoint("base")
    model, _, _ = load_model(path, dtype="float64")
    _skip_qk_norms(model)
    prompts = _prompts(5, seed=1)
    errors = [
        float((logits - hf_logits(hf, p)).abs().max())
        for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4))
    ]
    assert min(errors) > 0.05, errors  # the tolerance above is 2e-5


@pytest.mark.parametrize("skip_norms", [False, True], ids=["fused", "negative-control"])
def test_logits_match_transformers_bf16(checkpoint, kernel, monkeypatch, skip_norms):
    """The packed bf16 model runs the kernel's fused per-layer ops, q/k norms included."""
    path, hf = checkpoint("base")
    model, _, _ = load_model(path, dtype="bfloat16")  # packed
    original, calls = llama._norm_qk, []

    def counted(ops, qkv, attn):
        calls.append(attn)
        return qkv if skip_norms else original(ops, qkv, attn)

    monkeypatch.setattr(llama, "_norm_qk", counted)
    prompts = _prompts(4, seed=3)
    ours = ragged_prefill_logits(model, prompts, page_size=4)
    ref = bf16_reference(hf)
    assert len(calls) == model.config.num_layers  # the fused path ran, and normed every layer
    errors = [bf16_error(o, hf_logits(ref, p, torch.float32)) for p, o in zip(prompts, ours)]
    if skip_norms:
        assert min(errors) > 2 * BF16_TOL, errors
    else:
        assert max(errors) < BF16_TOL, errors


def test_fused_qk_norm_matches_torch_reference(checkpoint, kernel, monkeypatch):
    """The fused path's q/k norm against the module path (``Attention.forward``), both bf16."""
    path, _ = checkpoint("bias", **BIASED)
    model, _, _ = load_model(path, dtype="bfloat16", pack=False)
    prompts = _prompts(4, seed=4)
    fused = ragged_prefill_logits(model, prompts, page_size=4)
    monkeypatch.setattr(llama, "_fused_ops", lambda embeds: None)
    plain = ragged_prefill_logits(model, prompts, page_size=4)
    for a, b in zip(fused, plain):
        assert bf16_error(a, b) < 0.02


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft-model"])
def test_greedy_generation_matches_transformers(checkpoint, speculative):
    path, hf = checkpoint("base")
    draft_path, _ = checkpoint("draft", seed=7, draft_of="base")
    proposer = None
    if speculative:
        proposer = DraftModel.from_pretrained(draft_path, dtype="float64", num_speculative_tokens=3)
        drafted = record_drafts(proposer)
    gen = Generator.from_pretrained(
        path, dtype="float64", proposer=proposer, policy=3 if speculative else None
    )
    prompts = _prompts(6, seed=2)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, NEW_TOKENS)
    if speculative:
        assert drafted and gen.metrics.num_accepted > 0  # verify passes of several rows ran
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]


def _random_eagle3_head(target, seed: int):
    """A random EAGLE-3 head on the inputs of layers 0 and 1 and the last output (a Llama layer:
    no q/k norms, whatever the target), norms far from 1."""
    from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind

    torch.manual_seed(seed)
    head = EagleHeadModel(target, EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=(0, 1, 2)))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return head.to(target.dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("proposer", ["prompt-lookup", "eagle-tree"])
def test_greedy_with_prompt_lookup_and_an_eagle_tree_matches_transformers(checkpoint, proposer):
    path, hf = checkpoint("base")
    target, _, _ = load_model(path, dtype="float64")
    prompts = _prompts(5, seed=2, lengths=(6, 16))
    prompts[0] = prompts[0][:3] * 4  # repeats: prompt lookup has something to find
    if proposer == "prompt-lookup":
        drafts, k = PromptLookup(3), 3
    else:  # a dynamic tree, verified under the tree mask
        drafts = EAGLETree.from_model(_random_eagle3_head(target, seed=0), None)
        k = drafts.num_speculative_tokens
    assert_greedy_as_transformers(target, hf, drafts, k, prompts, NEW_TOKENS,
                                  expect_accepted=proposer == "eagle-tree")  # fmt: skip


def test_bf16_speculation_is_exact_through_the_stack_kernel(checkpoint, kernel, monkeypatch):
    """bf16 on the CPU backend: every layer in the whole-stack kernel (q/k norms included),
    decoding stays close to transformers, and speculation equals plain decoding token for token
    (the stack against the Python loop bit for bit: tests/unit/test_cpu_decoder.py)."""
    from specdec.models import cpu_decoder

    ran, run_stack = [], cpu_decoder.run_stack
    monkeypatch.setattr(cpu_decoder, "run_stack", lambda *a: ran.append(1) or run_stack(*a))
    path, hf = checkpoint("base")
    draft_path, _ = checkpoint("draft", seed=7, draft_of="base")
    prompts = _prompts(4, seed=5)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = Generator.from_pretrained(path).generate(prompts, params)  # bf16, packed
    spec = Generator.from_pretrained(
        path, proposer=DraftModel.from_pretrained(draft_path, num_speculative_tokens=3), policy=3
    )
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.metrics.num_accepted > 0 and ran
    ref = bf16_reference(hf)
    for p, out in zip(prompts, plain):
        logits = hf_logits(ref, p + out.token_ids, torch.float32)[len(p) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        # each bf16 token is transformers' argmax or within bf16 noise of it
        assert bool(
            (logits.max(-1).values - chosen <= BF16_TOL * (logits.max() - logits.min())).all()
        )


# The cosine of quantized and reference logits rows: q4 of 64-wide layers is coarse; with the q/k
# norms skipped both fall to 0.1-0.15.
@pytest.mark.parametrize(
    "quantization, cls, min_cosine", [("int8", Int8Linear, 0.99), ("q4", Q4Linear, 0.7)]
)
def test_quantized_checkpoint_loads_and_runs(
    checkpoint, kernel, monkeypatch, quantization, cls, min_cosine
):
    from specdec.models import loading

    path, hf = checkpoint("base")
    first, _, _ = load_model(path, quantization=quantization)
    monkeypatch.setattr(loading, "model_from_state_dict", None)  # the checkpoint is not read again
    second, _, _ = load_model(path, quantization=quantization)  # from the disk cache
    attn = second.layers[0].self_attn
    assert isinstance(attn.qkv_proj, cls) and isinstance(attn.o_proj, cls)
    assert attn.q_norm.weight.dtype == torch.bfloat16  # the norms stay as they were
    torch.testing.assert_close(
        attn.k_norm.weight,
        hf.model.layers[0].self_attn.k_norm.weight.to(torch.bfloat16),
        rtol=0,
        atol=0,
    )
    prompts = _prompts(3, seed=6)
    a = ragged_prefill_logits(first, prompts)
    b = ragged_prefill_logits(second, prompts)
    ref = bf16_reference(hf)
    for p, x, y in zip(prompts, a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
        cosine = torch.nn.functional.cosine_similarity(
            x.float(), hf_logits(ref, p, torch.float32), dim=-1
        )
        assert float(cosine.min()) > min_cosine, cosine
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Generator.from_components(second).generate(prompts, params)
    spec = Generator.from_components(second, proposer=DraftModel.from_model(first), policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]


WINDOW = 5
WINDOWED = dict(
    use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, attn_implementation="eager"
)


def test_sliding_window_on_every_layer(checkpoint):
    """``use_sliding_window`` with ``max_window_layers=0``: every layer attends to the last
    ``WINDOW`` tokens; each emitted token, plain and speculative, is transformers' argmax
    (eager attention, whose mask is transformers' own) and its logits match."""
    path, hf = checkpoint("window", seed=3, **WINDOWED)
    draft_path, _ = checkpoint("window-draft", seed=4, draft_of="window", **WINDOWED)
    assert hf.config._attn_implementation == "eager"
    assert set(hf.config.layer_types) == {"sliding_attention"}
    model, _, _ = load_model(path, dtype="float64")
    assert model.config.sliding_window == WINDOW
    vocab = model.config.vocab_size
    prompts = _prompts(3, seed=8, lengths=(2, 14))
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=vocab)
    draft = DraftModel.from_pretrained(draft_path, dtype="float64", num_speculative_tokens=6)
    for proposer in (None, draft):
        gen = Generator.from_components(
            model,
            proposer=proposer,
            policy=6 if proposer else None,
            cache_config=CacheConfig(page_size=4),
        )
        for p, out in zip(prompts, gen.generate(prompts, params)):
            ref = hf_logits(hf, p + out.token_ids)[len(p) - 1 : -1]
            assert out.token_ids == ref.argmax(-1).tolist()
            ours = torch.full((len(out.logprobs), vocab), float("nan"), dtype=F64)
            for i, step in enumerate(out.logprobs):
                ids, values = zip(*step.top)
                ours[i, list(ids)] = torch.tensor(values, dtype=F64)
            torch.testing.assert_close(ours, ref.log_softmax(-1), **HF_TOL)
    assert gen.metrics.num_accepted > 0
    # The control: the same weights without the window disagree past the first WINDOW rows.
    full = ModelConfig.from_hf_config(hf.config)
    unwindowed = model_from_state_dict(
        attrs.evolve(full, sliding_window=None), iter(hf.state_dict().items()),
        dtype=F64, device=torch.device("cpu"),
    )  # fmt: skip
    ids = _prompts(1, seed=9, lengths=(20, 21))[0]
    ours = ragged_prefill_logits(unwindowed, [ids])[0]
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(ours[:WINDOW], ref[:WINDOW], **HF_TOL)
    assert float((ours[WINDOW:] - ref[WINDOW:]).abs().amax(-1).min()) > 1e-3


def test_window_on_some_layers_is_refused():
    from transformers import Qwen3Config

    cfg = Qwen3Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    cfg.architectures = ["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_config(cfg)


def test_an_mtp_head_on_qwen3_norms_queries_and_keys_in_training_too(checkpoint):
    """An MTP head's layer is the target's architecture (q/k norms included): its training
    forward (forward_dense, through head_module.dense_qkv) equals its paged forward; without
    the norms in the training forward the two part."""
    from helpers import random_head

    from specdec.proposers import MTPHead

    target, _, _ = load_model(checkpoint("base")[0], dtype="float64")
    head = random_head(target, 1)
    assert head.layer.self_attn.q_norm is not None
    with torch.no_grad():  # non-trivial norms: a skipped norm must show
        head.layer.self_attn.q_norm.weight.copy_(1 + 0.5 * torch.randn(target.config.head_dim))
        head.layer.self_attn.k_norm.weight.copy_(1 + 0.5 * torch.randn(target.config.head_dim))
    gen = Generator.from_components(target, proposer=MTPHead.from_model(head))
    kv, backend = gen.engine.proposer_kv, gen.engine.backend
    g = torch.Generator().manual_seed(0)
    hidden_size, vocab = target.config.hidden_size, target.config.vocab_size
    hid = torch.randn(9, hidden_size, generator=g, dtype=torch.float64)
    toks = torch.randint(0, vocab, (9,), generator=g).tolist()
    kv.manager.add_sequence(0)
    kv.manager.reserve(0, 9)
    layout = kv.layout([0], [toks], [0])
    plan = backend.plan(layout, target.config.attention_spec)
    paged = head(hid, layout.token_ids, layout.positions, kv, backend, plan)
    dense = head.forward_dense(hid[None], torch.tensor(toks)[None])[0]
    torch.testing.assert_close(paged, dense, rtol=1e-10, atol=1e-10)
    attn = head.layer.self_attn
    norms = attn.q_norm, attn.k_norm
    attn.q_norm = attn.k_norm = None  # the training forward of before: no norms
    try:
        assert not torch.allclose(head.forward_dense(hid[None], torch.tensor(toks)[None])[0], paged)
    finally:
        attn.q_norm, attn.k_norm = norms


def test_an_eagle_head_on_qwen3_is_a_llama_layer(checkpoint):
    """EAGLE heads (public EAGLE-3 heads for Qwen3 included) have no q/k norms and use SiLU,
    whatever the target's architecture."""
    from specdec.models.eagle_head import EagleHeadConfig, EagleKind

    target, _, _ = load_model(checkpoint("base")[0], dtype="float64")
    for kind in EagleKind:
        layers = (0, 1, 2) if kind is EagleKind.EAGLE3 else None  # a 2-layer target
        head = EagleHeadConfig.for_target(target.config, kind, target_layers=layers)
        layer = head.layer_config(target.config)
        assert not layer.qk_norm and layer.hidden_act == "silu"
    assert target.config.qk_norm


# --- GGUF files as llama.cpp writes qwen3 (the gguf package) ------------------------------------

_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
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
GGUF_EPS = 2.0**-20  # exact in float32: the file's eps is the config's, bit for bit
GGUF_VARIANTS = {
    "base": dict(seed=3, rms_norm_eps=GGUF_EPS),
    "bias-tied": dict(
        seed=4, rms_norm_eps=GGUF_EPS, attention_bias=True, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
    ),
}  # fmt: skip


def _gguf_name(hf_name: str) -> str:
    import re

    module, leaf = hf_name.rsplit(".", 1)
    if module in _GGUF_TOP:
        return f"{_GGUF_TOP[module]}.{leaf}"
    layer, inner = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module).groups()
    return f"blk.{layer}.{_GGUF_BLOCK[inner]}.{leaf}"


def write_qwen3_gguf(path, model, qtype, *, key_length: bool = True, extra=None) -> None:
    """``model`` (float32) as llama.cpp's convert_hf_to_gguf.py writes Qwen3 (``Qwen3Model``, a
    ``Qwen2Model``): its tensor names, q/k rows as they are (no permutation: llama.cpp rotates
    Qwen2/Qwen3 NeoX-style), the per-head q/k norms as ``attn_q_norm``/``attn_k_norm``,
    ``head_dim`` as ``attention.key_length``/``value_length`` (``key_length=False``: a file
    without them), 1-D tensors F32, no ``output.weight`` when tied. ``extra``: more keys
    (``"qwen3.<key>"`` -> string)."""
    import gguf

    cfg = model.config
    writer = gguf_writer(path, "qwen3", cfg, head_dim=key_length)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    ftype = gguf.LlamaFileType.ALL_F32 if qtype == "f32" else gguf.LlamaFileType.MOSTLY_Q4_0
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensor_type = (
        gguf.GGMLQuantizationType.F32 if qtype == "f32" else gguf.GGMLQuantizationType.Q4_0
    )
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        data = tensor.float().numpy()
        if data.ndim == 1 or tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), data)
        else:
            blocks = gguf.quants.quantize(data, tensor_type)
            writer.add_tensor(
                _gguf_name(name), blocks, raw_shape=blocks.shape, raw_dtype=tensor_type
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """(variant, "f32" | "q4_0") -> (GGUF file, safetensors directory of the same float32
    weights, transformers' float64 model of them)."""
    pytest.importorskip("gguf")
    cache: dict[tuple[str, str], tuple] = {}

    def build(variant: str, qtype: str):
        if (variant, qtype) not in cache:
            source = make_qwen3(**GGUF_VARIANTS[variant]).float()
            root = tmp_path_factory.mktemp(f"gguf-qwen3-{variant}-{qtype}")
            write_qwen3_gguf(root / f"tiny-qwen3-{qtype}.gguf", source, qtype)
            source.save_pretrained(root / "safetensors", safe_serialization=True)
            cache[variant, qtype] = (
                root / f"tiny-qwen3-{qtype}.gguf",
                root / "safetensors",
                source.double(),
            )
        return cache[variant, qtype]

    return build


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_gguf_loads_as_its_safetensors(gguf_files, variant):
    """An F32 qwen3 file: the config (head_dim 24 from attention.key_length, biases and tied
    embeddings from its tensors) and the float64 logits of the safetensors load of the same
    weights exactly, and transformers' within the float64 tolerance."""
    path, safetensors, hf = gguf_files(variant, "f32")
    model, _, _ = load_model(path, dtype="float64")
    want, _, _ = load_model(safetensors, dtype="float64")
    assert model.config.head_dim == 24 and model.config.qk_norm
    assert model.config.qkv_bias == model.config.o_bias == (variant == "bias-tied")
    assert model.config.tie_word_embeddings == (variant == "bias-tied")
    # the file has no EOS key here: Qwen3Config's default fills it
    assert attrs.evolve(model.config, eos_token_ids=()) == attrs.evolve(
        want.config, eos_token_ids=()
    )
    ours, theirs = model.state_dict(), want.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    prompts = _prompts(4, seed=4, lengths=(4, 20))
    reference = ragged_prefill_logits(want, prompts, page_size=4)
    for p, a, b in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4), reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, hf_logits(hf, p), **HF_TOL)


@pytest.mark.parametrize("control", ["permuted-qk", "no-qk-norms"])
def test_gguf_negative_controls_disagree(gguf_files, monkeypatch, control):
    """A loader that un-permutes the q/k rows as for llama files, or a model without the q/k
    norms the file holds, leaves transformers far behind: the test above would catch either."""
    from specdec.models.gguf_file import GgufFile

    path, _, hf = gguf_files("base", "f32")
    if control == "permuted-qk":
        monkeypatch.setattr(GgufFile, "permutes_qk", property(lambda self: True))
    model, _, _ = load_model(path, dtype="float64")
    if control == "no-qk-norms":
        _skip_qk_norms(model)
    prompts = _prompts(4, seed=4, lengths=(4, 20))  # a 1-token prompt never sees q/k
    errors = [
        float((logits - hf_logits(hf, p)).abs().max())
        for p, logits in zip(prompts, ragged_prefill_logits(model, prompts, page_size=4))
    ]
    assert min(errors) > 0.05, errors  # the tolerance above is 2e-5


def test_gguf_without_key_length_takes_head_dim_from_the_q_rows(gguf_files, tmp_path):
    """A file without attention.key_length: head_dim is the q rows per head (24), not
    Qwen3Config's default (128)."""
    import copy

    _, safetensors, hf = gguf_files("base", "f32")
    path = tmp_path / "no-key-length.gguf"
    write_qwen3_gguf(path, copy.deepcopy(hf).float(), "f32", key_length=False)
    model, _, _ = load_model(path, dtype="float64")
    want, _, _ = load_model(safetensors, dtype="float64")
    assert attrs.evolve(model.config, eos_token_ids=()) == attrs.evolve(
        want.config, eos_token_ids=()
    )


def test_gguf_q4_keeps_the_files_codes(gguf_files, kernel, monkeypatch):
    """``quantization="q4"`` of a Q4_0 qwen3 file, read tensor by tensor: every linear layer is
    the file's codes (its dequantized weight is the dense load's exactly, q/k rows unpermuted),
    the norms (q/k norms included) are the dense load's bit for bit, and speculative greedy
    decoding on it equals its plain decoding."""
    from specdec.models.gguf_file import GgufFile

    path, _, _ = gguf_files("base", "q4_0")
    q4, _, _ = load_model(path, quantization="q4")
    dense32, _, _ = load_model(path, dtype="float32", pack=False)
    linears = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    for i in range(TINY["num_hidden_layers"]):
        for name in linears:
            ours = q4.layers[i].get_submodule(name)
            assert isinstance(ours, Q4Linear)
            want = dense32.layers[i].get_submodule(name).weight
            torch.testing.assert_close(ours.dequantized(), want, rtol=0, atol=0)
    assert isinstance(q4.lm_head, Q4Linear)
    torch.testing.assert_close(q4.lm_head.dequantized(), dense32.lm_head.weight, rtol=0, atol=0)
    dense, _, _ = load_model(path, dtype="bfloat16", pack=False)
    norms = {n: t for n, t in dense.state_dict().items() if n.endswith("norm.weight")}
    assert len(norms) == 4 * TINY["num_hidden_layers"] + 1
    q4_state = q4.state_dict()
    assert all(torch.equal(q4_state[n], t) for n, t in norms.items())
    prompts = _prompts(3, seed=6, lengths=(4, 16))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Generator.from_components(q4).generate(prompts, params)
    spec = Generator.from_components(q4, proposer=DraftModel.from_model(dense), policy=3)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.metrics.num_accepted > 0
    # the control: q/k rows un-permuted as for llama files are not the dense load's rows
    monkeypatch.setattr(GgufFile, "permutes_qk", property(lambda self: True))
    permuted, _, _ = load_model(path, quantization="q4")
    qkv = permuted.layers[0].self_attn.qkv_proj.dequantized()
    assert not torch.equal(qkv, dense32.layers[0].self_attn.qkv_proj.weight)


def test_gguf_rope_scaled_files_are_refused(tmp_path):
    """llama.cpp writes Qwen3's YaRN scaling as keys this reader does not map: refused, naming
    the key, rather than rotated unscaled."""
    pytest.importorskip("gguf")
    from specdec.models.gguf_file import GgufFile

    metadata = {"general.architecture": "qwen3", "qwen3.rope.scaling.type": "yarn"}
    file = GgufFile(tmp_path / "yarn.gguf", metadata, {})
    with pytest.raises(
        ValueError, match=r"yarn.gguf: GGUF key qwen3.rope.scaling.type='yarn' is not"
    ):
        file.config_dict()
