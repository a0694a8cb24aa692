"""Qwen3 (dense) against Hugging Face transformers, the reference.

Qwen3 is Qwen2's decoder plus a per-head RMSNorm of queries and keys (``self_attn.q_norm``,
``self_attn.k_norm``, over ``head_dim``, before RoPE), q/k/v/o biases only with
``attention_bias``, and a ``head_dim`` of its own (24 here, where hidden / heads is 16). Tiny
random checkpoints written by transformers' ``save_pretrained`` are loaded through specdec's
loaders and compared with transformers' own model of the same files:

- logits of a ragged prefill: float64 (the plain torch layers) and bf16 (the kernel's fused ops,
  whose q/k norm is ``llama._norm_qk``; the whole-stack kernel has none and is skipped);
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
    bf16_error,
    bf16_reference,
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
from specdec.proposers import DraftModel

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


def test_bf16_speculation_is_exact_and_skips_the_stack_kernel(checkpoint, kernel, monkeypatch):
    """bf16 on the CPU backend: the whole-stack kernel (no q/k norm) is never used, decoding
    stays close to transformers, and speculation equals plain decoding token for token."""
    from specdec.models import cpu_decoder

    def forbidden(*args, **kwargs):
        raise AssertionError("the whole-stack kernel has no q/k norm")

    monkeypatch.setattr(cpu_decoder, "run_stack", forbidden)
    path, hf = checkpoint("base")
    draft_path, _ = checkpoint("draft", seed=7, draft_of="base")
    prompts = _prompts(4, seed=5)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = Generator.from_pretrained(path).generate(prompts, params)  # bf16, packed
    spec = Generator.from_pretrained(
        path, proposer=DraftModel.from_pretrained(draft_path, num_speculative_tokens=3), policy=3
    )
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.metrics.num_accepted > 0
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
