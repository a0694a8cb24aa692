"""EAGLE heads: target hidden states of chosen layers, the three checkpoint layouts against an
independent transcription of the reference heads, paged == dense, save/load, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specdec.attention import TorchAttentionBackend
from specdec.kv import KVCacheManager, PageAllocator
from specdec.models.eagle_checkpoints import load_eagle_head, save_eagle_head
from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind

F64 = torch.float64
H, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 64, 4, 2, 96, 101, 8
HD = H // HEADS
E3_LAYERS = (2, 4, 5)  # the reference's (2, N // 2, N - 3) for N = 8


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf8():
    from conftest import make_hf_model

    return make_hf_model("llama", seed=3, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def target(hf8):
    from specdec.models.llama import ModelConfig
    from specdec.models.loading import model_from_state_dict

    cfg = ModelConfig.from_hf_config(hf8.config)
    return model_from_state_dict(
        cfg, iter(hf8.state_dict().items()), dtype=F64, device=torch.device("cpu")
    )


def _cache(spec, lengths, page_size=4):
    """A pool for ``spec`` with sequences 0.. reserved, interleaved so pages are scattered."""
    manager = KVCacheManager(PageAllocator(256), page_size)
    kv = manager.add_pool(spec, "cpu")
    for i in range(len(lengths)):
        manager.add_sequence(i)
    for step in range(max(lengths)):
        for i, n in enumerate(lengths):
            if step < n:
                manager.reserve(i, step + 1)
    return kv


def _run_target(model, prompts, **kwargs):
    kv = _cache(model.config.kv_spec("target", model.dtype), [len(p) for p in prompts])
    backend = TorchAttentionBackend()
    layout = kv.layout(list(range(len(prompts))), prompts, [0] * len(prompts))
    return model(layout, kv, backend, backend.plan(layout, model.config.attention_spec), **kwargs)


def _tokens(n, seed, vocab=VOCAB):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------- section 1: hidden_layers
def test_hidden_layers_equal_transformers_hidden_states(hf8, target):
    prompts = [_tokens(7, 1), _tokens(12, 2)]
    layers = (0, 3, LAYERS, 3)  # order kept, repeats allowed
    out = _run_target(target, prompts, hidden_layers=layers)
    assert out.hidden_states.shape == (19, len(layers) * H)
    plain = _run_target(target, prompts, return_hidden=True)
    assert torch.equal(plain.hidden_states, out.hidden_states[:, 2 * H : 3 * H])
    assert torch.equal(plain.logits, out.logits)
    for p, ours in zip(prompts, out.hidden_states.split([len(p) for p in prompts])):
        with torch.no_grad():
            ref = hf8(
                torch.tensor([p]), output_hidden_states=True
            ).hidden_states  # [N + 1] x [1, T, H]
        for chunk, i in zip(ours.split(H, dim=-1), layers):
            # HF's last entry is after the final norm; ours is the residual stream before it.
            got = target.norm(chunk) if i == LAYERS else chunk
            torch.testing.assert_close(got, ref[i][0], rtol=1e-5, atol=2e-5)


def test_hidden_layers_bad_arguments(target):
    with pytest.raises(ValueError, match="not both"):
        _run_target(target, [[1, 2]], return_hidden=True, hidden_layers=(1,))
    with pytest.raises(ValueError, match=r"0\.\.8"):
        _run_target(target, [[1, 2]], hidden_layers=(9,))
    with pytest.raises(ValueError, match="at least one"):
        _run_target(target, [[1, 2]], hidden_layers=())


@pytest.mark.usefixtures("kernel")
def test_hidden_layers_fused_bf16_path_equals_plain_path(hf8, monkeypatch):
    from specdec.models import llama
    from specdec.models.loading import model_from_state_dict

    cfg = llama.ModelConfig.from_hf_config(hf8.config)
    model = model_from_state_dict(
        cfg, iter(hf8.state_dict().items()), dtype=torch.bfloat16, device=torch.device("cpu")
    )
    prompts, layers = [_tokens(5, 3), _tokens(9, 4)], (0, 2, 5, LAYERS)
    calls, real = [], llama._fused_ops
    monkeypatch.setattr(llama, "_fused_ops", lambda e: calls.append(1) or real(e))
    fused = _run_target(model, prompts, hidden_layers=layers)
    assert calls and real(torch.zeros(1, 4, dtype=torch.bfloat16)) is not None  # the fused path ran
    monkeypatch.setattr(llama, "_fused_ops", lambda e: None)
    plain = _run_target(model, prompts, hidden_layers=layers)
    assert torch.equal(
        fused.hidden_states[:, :H], plain.hidden_states[:, :H]
    )  # layer 0: the embeddings
    for a, b in zip(fused.hidden_states.split(H, -1), plain.hidden_states.split(H, -1)):
        scale = float(b.float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=0.03, atol=0.03 * scale)


# ---------------------------------------------- an independent reference head
def _ref_rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _ref_rope(
    x, positions, theta
):  # x [T, h, d]; the reference's float32 cos/sin (cnets.py:117-133)
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.einsum("i,j->ij", positions.float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1) * sin


def _ref_block(w, p, attn_in, residual, positions, visible, theta):
    """One EAGLE decoder layer over all rows at once; ``visible [T, T]`` says who sees whom."""
    t = attn_in.shape[0]

    def lin(name, x):
        y = x @ w[p + name + ".weight"].T
        return y + w[p + name + ".bias"] if p + name + ".bias" in w else y

    q = _ref_rope(lin("self_attn.q_proj", attn_in).view(t, HEADS, HD), positions, theta)
    k = _ref_rope(lin("self_attn.k_proj", attn_in).view(t, KV_HEADS, HD), positions, theta)
    v = lin("self_attn.v_proj", attn_in).view(t, KV_HEADS, HD)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HD**0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    h = residual + lin("self_attn.o_proj", torch.einsum("hqk,khd->qhd", probs, v).reshape(t, H))
    m = _ref_rms(h, w[p + "post_attention_layernorm.weight"])
    return h + lin("mlp.down_proj", F.silu(lin("mlp.gate_proj", m)) * lin("mlp.up_proj", m))


def _ref_eagle1(w, embed, feature, tokens, positions, visible, theta):
    x = torch.cat((embed[tokens], feature), -1) @ w["fc.weight"].T + w["fc.bias"]
    return _ref_block(w, "layers.0.", x, x, positions, visible, theta)


def _ref_eagle3(w, embed, feature, tokens, positions, visible, theta):
    if feature.shape[-1] != H:
        feature = feature @ w["fc.weight"].T
    a = torch.cat((_ref_rms(embed[tokens], w["midlayer.input_layernorm.weight"]),
                   _ref_rms(feature, w["midlayer.hidden_norm.weight"])), -1)  # fmt: skip
    return _ref_block(w, "midlayer.", a, feature, positions, visible, theta)


def _ref_eagle3_logits(w, g):
    draft = _ref_rms(g, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((g.shape[0], VOCAB), float("-inf"), dtype=g.dtype)
    full[:, torch.arange(draft.shape[1]) + w["d2t"]] = draft
    return full


# ------------------------------------------------------ public checkpoints
def _layer_tensors(g, prefix, in_features, *, qkv_bias=False):
    def r(*shape):
        return 0.2 * torch.randn(*shape, generator=g, dtype=F64)

    t = {
        f"{prefix}self_attn.q_proj.weight": r(HEADS * HD, in_features),
        f"{prefix}self_attn.k_proj.weight": r(KV_HEADS * HD, in_features),
        f"{prefix}self_attn.v_proj.weight": r(KV_HEADS * HD, in_features),
        f"{prefix}self_attn.o_proj.weight": r(H, HEADS * HD),
        f"{prefix}mlp.gate_proj.weight": r(INTER, H),
        f"{prefix}mlp.up_proj.weight": r(INTER, H),
        f"{prefix}mlp.down_proj.weight": r(H, INTER),
        f"{prefix}post_attention_layernorm.weight": 1
        + 0.1 * torch.randn(H, generator=g, dtype=F64),
    }
    if qkv_bias:
        for name, rows in (("q", HEADS * HD), ("k", KV_HEADS * HD), ("v", KV_HEADS * HD)):
            t[f"{prefix}self_attn.{name}_proj.bias"] = r(rows)
    return t


def _head_config(**extra):
    return dict(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                num_hidden_layers=1, vocab_size=VOCAB, rms_norm_eps=1e-6, **extra)  # fmt: skip


def eagle1_checkpoint(seed=0, qkv_bias=True):
    g = torch.Generator().manual_seed(seed)
    t = _layer_tensors(g, "layers.0.", H, qkv_bias=qkv_bias)
    t["fc.weight"] = 0.2 * torch.randn(H, 2 * H, generator=g, dtype=F64)
    t["fc.bias"] = 0.1 * torch.randn(H, generator=g, dtype=F64)
    return t, _head_config(
        architectures=["LlamaForCausalLM"], rope_theta=5000.0, bias=True, qkv_bias=qkv_bias
    )


def eagle3_checkpoint(seed=0, draft_vocab=40):
    g = torch.Generator().manual_seed(seed)
    t = _layer_tensors(g, "midlayer.", 2 * H)
    for name in ("input_layernorm", "hidden_norm"):
        t[f"midlayer.{name}.weight"] = 1 + 0.1 * torch.randn(H, generator=g, dtype=F64)
    t["fc.weight"] = 0.1 * torch.randn(H, 3 * H, generator=g, dtype=F64)
    t["norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g, dtype=F64)
    t["lm_head.weight"] = 0.2 * torch.randn(draft_vocab, H, generator=g, dtype=F64)
    ids = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
    t["d2t"] = ids - torch.arange(draft_vocab)
    t["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)
    cfg = _head_config(
        architectures=["LlamaForCausalLMEagle3"], rope_theta=2000.0, draft_vocab_size=draft_vocab
    )
    return t, cfg


def write(directory, tensors, config):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _features(target, kind, tokens):
    """The target feature rows of ``tokens`` as the reference computes them (``f_0 .. f_{n-1}``)."""
    layers = (LAYERS,) if kind is EagleKind.EAGLE1 else E3_LAYERS
    hidden = _run_target(target, [tokens], hidden_layers=layers).hidden_states
    return hidden, (_ref_rms(hidden, target.norm.weight) if kind is EagleKind.EAGLE1 else hidden)


def _paged_chain_and_tree(head, feature_rows, tokens):
    """Head rows for a committed prefix (causal), then one tree step of three drafts:
    d0 and d1 children of the last row, d2 child of d0 (positions n, n, n + 1)."""
    n = len(tokens)
    kv = _cache(head.kv_spec(), [n + 3])
    backend = TorchAttentionBackend()
    layout = kv.layout([0], [tokens], [0])
    g = head(head.target_feature(feature_rows), layout.token_ids, layout.positions, kv, backend,
             backend.plan(layout, head.attention_spec))  # fmt: skip
    drafts = _tokens(3, 9)
    tree = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    layout = kv.layout([0], [drafts], [n], positions=[[n, n, n + 1]], tree_masks=[tree])
    feats = torch.stack((g[-1], g[-1], g[-1] * 0.5))
    g_tree = head(
        feats,
        layout.token_ids,
        layout.positions,
        kv,
        backend,
        backend.plan(layout, head.attention_spec),
    )
    visible = torch.ones(n + 3, n + 3, dtype=torch.bool).tril()
    visible[n:, n:] = tree
    return torch.cat((g, g_tree)), feats, drafts, visible


@pytest.mark.parametrize("kind", [EagleKind.EAGLE1, EagleKind.EAGLE3])
def test_public_checkpoint_matches_the_reference_head(tmp_path, target, kind):
    tensors, config = eagle1_checkpoint() if kind is EagleKind.EAGLE1 else eagle3_checkpoint()
    head = load_eagle_head(write(tmp_path, tensors, config), target)
    assert head.config.kind is kind and head.config.target_layers == (
        (LAYERS,) if kind is EagleKind.EAGLE1 else E3_LAYERS
    )
    seq = _tokens(9, 5)
    hidden, ref_feature = _features(target, kind, seq[:-1])
    g, feats, drafts, visible = _paged_chain_and_tree(head, hidden, seq[1:])
    n = len(seq) - 1
    positions = torch.tensor([*range(n), n, n, n + 1])
    all_tokens = torch.tensor(seq[1:] + drafts)
    ref_fn, theta = (_ref_eagle1, 5000.0) if kind is EagleKind.EAGLE1 else (_ref_eagle3, 2000.0)
    if kind is EagleKind.EAGLE3:
        ref_feature = ref_feature @ tensors["fc.weight"].T
    ref = ref_fn(
        tensors,
        target.embed_tokens.weight,
        torch.cat((ref_feature, feats)),
        all_tokens,
        positions,
        visible,
        theta,
    )
    torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-9)
    want = (
        g @ target.lm_head.weight.T
        if kind is EagleKind.EAGLE1
        else _ref_eagle3_logits(tensors, ref)
    )
    torch.testing.assert_close(head.logits(g), want, rtol=1e-9, atol=1e-9)


def test_eagle3_logits_live_on_the_draft_vocabulary(tmp_path, target):
    tensors, config = eagle3_checkpoint(seed=2, draft_vocab=17)
    head = load_eagle_head(write(tmp_path, tensors, config), target)
    ids = torch.arange(17) + tensors["d2t"]
    assert torch.equal(head.draft_to_target, ids)
    g = torch.randn(5, H, dtype=F64, generator=torch.Generator().manual_seed(0))
    logits = head.logits(g)
    assert logits.shape == (5, VOCAB) and logits.dtype == F64
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, ids, False)
    assert bool(torch.isneginf(logits[:, outside]).all()) and bool(
        torch.isfinite(logits[:, ids]).all()
    )
    draft = _ref_rms(g, tensors["norm.weight"]) @ tensors["lm_head.weight"].T  # [5, 17]
    torch.testing.assert_close(logits[:, ids], draft, rtol=1e-12, atol=1e-12)
    assert torch.equal(logits.argmax(-1), ids[draft.argmax(-1)])


def test_eagle3_full_vocabulary_ignores_d2t(tmp_path, target):
    tensors, config = eagle3_checkpoint(seed=4, draft_vocab=VOCAB)
    tensors["d2t"] = torch.full(
        (VOCAB,), 7
    )  # ignored, as the reference deletes it (ea_model.py:74-75)
    head = load_eagle_head(write(tmp_path, tensors, config), target)
    assert torch.equal(head.draft_to_target, torch.arange(VOCAB))
    g = torch.randn(3, H, dtype=F64)
    torch.testing.assert_close(
        head.logits(g), _ref_rms(g, tensors["norm.weight"]) @ tensors["lm_head.weight"].T
    )


# ------------------------------------------------------ own heads and format
def _random_head(target, kind, seed=0, **kwargs):
    torch.manual_seed(seed)
    layers = (LAYERS,) if kind is EagleKind.EAGLE1 else (1, 6)
    head = EagleHeadModel(
        target, EagleHeadConfig.for_target(target.config, kind, target_layers=layers, **kwargs)
    )
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        if kind is EagleKind.EAGLE3 and head.config.draft_vocab_size < VOCAB:
            head.d2t.copy_(
                torch.randperm(VOCAB)[: head.config.draft_vocab_size].sort().values
                - torch.arange(head.config.draft_vocab_size)
            )
    return head.to(F64).eval().requires_grad_(False)


@pytest.mark.parametrize(
    "kind, kwargs",
    [
        (EagleKind.EAGLE1, {}),
        (EagleKind.EAGLE1, {"input_norm": True, "fc_bias": False}),
        (EagleKind.EAGLE3, {}),
    ],
)
def test_paged_forward_equals_dense(target, kind, kwargs):
    head = _random_head(target, kind, 1, **kwargs)
    lengths = [5, 1, 8]
    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(n, H, generator=g, dtype=F64) for n in lengths]
    toks = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    kv = _cache(head.kv_spec(), lengths)
    backend = TorchAttentionBackend()
    layout = kv.layout([0, 1, 2], toks, [0, 0, 0])
    paged = head(
        torch.cat(feats),
        layout.token_ids,
        layout.positions,
        kv,
        backend,
        backend.plan(layout, head.attention_spec),
    )
    dense = torch.cat(
        [head.forward_dense(f[None], torch.tensor(t)[None])[0] for f, t in zip(feats, toks)]
    )
    torch.testing.assert_close(paged, dense, rtol=1e-10, atol=1e-10)


def test_forward_dense_trains(target):
    head = _random_head(target, EagleKind.EAGLE3, 2).requires_grad_(True)
    hidden = torch.randn(2, 6, 2 * H, dtype=F64)
    out = head.forward_dense(head.target_feature(hidden), torch.randint(0, VOCAB, (2, 6)))
    out.square().mean().backward()
    assert (
        head.fc.weight.grad is not None
        and head.layer.self_attn.qkv_proj.weight.grad.abs().sum() > 0
    )
    assert target.embed_tokens.weight.grad is None  # borrowed, not trained


@pytest.mark.parametrize(
    "kind, kwargs",
    [(EagleKind.EAGLE1, {"input_norm": True}), (EagleKind.EAGLE3, {"draft_vocab_size": 30})],
)
def test_save_load_round_trip(tmp_path, target, kind, kwargs):
    head = _random_head(target, kind, 3, **kwargs)
    save_eagle_head(head, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["format"] == "specdec-eagle-head"
    loaded = load_eagle_head(tmp_path, target)
    assert loaded.config == head.config
    for (name, a), (_, b) in zip(
        sorted(head.state_dict().items()), sorted(loaded.state_dict().items())
    ):
        assert torch.equal(a, b), name
    feats, toks = torch.randn(4, H, dtype=F64), torch.tensor(_tokens(4, 1))
    outs = []
    for h in (head, loaded):
        kv = _cache(h.kv_spec(), [4])
        backend = TorchAttentionBackend()
        layout = kv.layout([0], [toks.tolist()], [0])
        outs.append(
            h.logits(
                h(
                    feats,
                    toks,
                    layout.positions,
                    kv,
                    backend,
                    backend.plan(layout, h.attention_spec),
                )
            )
        )
    assert torch.equal(outs[0], outs[1])


def test_bf16_load_packs_and_stays_close(tmp_path, target):
    tensors, config = eagle3_checkpoint(seed=6)
    path = write(tmp_path, tensors, config)
    exact, bf16 = load_eagle_head(path, target), load_eagle_head(path, target, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.d2t.dtype == torch.int64
    feats = torch.randn(3, 3 * H, dtype=F64)
    toks = torch.tensor(_tokens(3, 2))
    outs = []
    for h in (exact, bf16):
        kv = _cache(h.kv_spec(), [3])
        backend = TorchAttentionBackend()
        layout = kv.layout([0], [toks.tolist()], [0])
        g = h(
            h.target_feature(feats),
            toks,
            layout.positions,
            kv,
            backend,
            backend.plan(layout, h.attention_spec),
        )
        outs.append(h.logits(g))
    assert outs[1].dtype == torch.float32
    finite = torch.isfinite(outs[0])
    assert torch.equal(finite, torch.isfinite(outs[1]))
    torch.testing.assert_close(outs[1][finite].double(), outs[0][finite], rtol=0.05, atol=0.15)


# ---------------------------------------------------------------- bad input
def _expect(tmp_path, target, tensors, config, error, match):
    with pytest.raises(error, match=match):
        load_eagle_head(write(tmp_path, tensors, config), target)


def test_wrong_keys_and_shapes_are_named(tmp_path, target):
    t, c = eagle3_checkpoint()
    del t["midlayer.hidden_norm.weight"]
    _expect(
        tmp_path / "a",
        target,
        t,
        c,
        ValueError,
        r"model\.safetensors.*missing \['midlayer\.hidden_norm\.weight'\]",
    )
    t, c = eagle1_checkpoint()
    t["layers.1.mlp.down_proj.weight"] = torch.zeros(H, INTER)
    del t["layers.0.self_attn.k_proj.weight"]
    _expect(
        tmp_path / "b",
        target,
        t,
        c,
        ValueError,
        r"missing \['layers\.0\.self_attn\.k_proj\.weight'\], unexpected \['layers\.1\.mlp",
    )
    t, c = eagle3_checkpoint()
    t["fc.weight"] = torch.zeros(H, 2 * H, dtype=F64)
    _expect(
        tmp_path / "c",
        target,
        t,
        c,
        ValueError,
        r"wrong shape.*fc\.weight \(64, 128\) != \(64, 192\)",
    )
    t, c = eagle3_checkpoint()
    t["d2t"][3] = t["d2t"][4] + 1  # two draft ids on one target id
    _expect(tmp_path / "d", target, t, c, ValueError, "d2t must map")
    t, c = eagle1_checkpoint()
    _expect(
        tmp_path / "e", target, {"foo": torch.zeros(1)}, c, ValueError, "neither a specdec head"
    )
    t, c = eagle1_checkpoint()
    c["bias"] = False
    _expect(tmp_path / "f", target, t, c, ValueError, "bias=False but fc.bias is present")


def test_wrong_target_is_refused(tmp_path, target, tiny_checkpoint):
    from specdec.models.loading import load_model

    t, c = eagle1_checkpoint()
    _expect(tmp_path / "a", target, t, dict(c, vocab_size=VOCAB + 1), ValueError, "vocab_size")
    _expect(tmp_path / "b", target, t, dict(c, num_hidden_layers=2), ValueError, "one layer")
    save_eagle_head(_random_head(target, EagleKind.EAGLE1), tmp_path / "own")
    other, _, _ = load_model(tiny_checkpoint("qwen2"), dtype="float64")
    with pytest.raises(
        ValueError, match="does not fit this target.*hidden_size|does not fit this target"
    ):
        load_eagle_head(tmp_path / "own", other)
    with pytest.raises(ValueError, match="target_layers is recorded"):
        load_eagle_head(tmp_path / "own", target, target_layers=(1,))
    with pytest.raises(ValueError, match="N >= 7"):
        EagleHeadConfig.for_target(other.config, EagleKind.EAGLE3)
    with pytest.raises(ValueError, match="EAGLE-1 head feeds on target_layers"):
        EagleHeadConfig.for_target(target.config, EagleKind.EAGLE1, target_layers=(3,))
    with pytest.raises(ValueError, match="EAGLE-3 head has no fc_bias"):
        EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, fc_bias=True)
    head = _random_head(target, EagleKind.EAGLE3)
    with pytest.raises(ValueError, match=r"target_hidden must be \[\.\.\., 128\]"):
        head.target_feature(torch.zeros(2, H, dtype=F64))


def test_missing_files(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_eagle_head(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps(eagle1_checkpoint()[1]))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="safetensors only"):
        load_eagle_head(tmp_path, target)
