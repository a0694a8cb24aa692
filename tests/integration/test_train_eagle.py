"""EAGLE training (``specdec train-eagle``): multi-layer feature caches, the unrolled
training-time-test forward against the causal forward it must equal, the trainer (it learns,
the head beats an untrained one through the Generator, it resumes exactly), config errors, the
CLI end to end, and the bundled stories260K head (greedy output equals plain decoding)."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from specdec import FixedPolicy, Generator, SamplingParams
from specdec.attention import TorchAttentionBackend
from specdec.cli import bundled_model_path, main
from specdec.kv import KVCacheManager, PageAllocator
from specdec.models.eagle_checkpoints import load_eagle_head
from specdec.models.eagle_head import EagleKind
from specdec.models.llama import rms_norm
from specdec.models.loading import load_model
from specdec.proposers import EAGLETree
from specdec.training import EagleTrainConfig, compute_features, train_eagle
from specdec.training import features as features_module
from specdec.training.eagle import (
    chain_tree,
    eagle_feature_layers,
    measure_eagle,
    new_eagle_head,
    unrolled_outputs,
)

E3 = dict(kind=EagleKind.EAGLE3, target_layers=(1, 2, 3), draft_vocab_size=300)


@pytest.fixture(scope="module")
def stories_f32(stories_path):
    target, _, _ = load_model(stories_path, dtype="float32")
    return target


@pytest.fixture(scope="module")
def distilled(stories_path):
    """The target's own sampled stories, cut into 64-token chunks (the last 4 held out)."""
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    params = [
        SamplingParams(max_new_tokens=256, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(40)
    ]
    outs = gen.generate([[1]] * 40, params)
    seqs = [[1, *o.token_ids] for o in outs]
    return [s[j : j + 64] for s in seqs for j in range(0, 257 - 64, 64)]


@pytest.fixture(scope="module")
def e1_store(stories_f32, distilled, tmp_path_factory):
    return compute_features(stories_f32, distilled[:-4], tmp_path_factory.mktemp("e1"), log=None)


def _prefill_states(target, tokens, layers):
    """One sequence through the target's plain forward with ``hidden_layers`` (a fresh cache)."""
    manager = KVCacheManager(PageAllocator(64), 16)
    kv = manager.add_pool(target.config.kv_spec("target", target.dtype), "cpu")
    manager.add_sequence(0)
    manager.reserve(0, len(tokens))
    backend = TorchAttentionBackend()
    layout = kv.layout([0], [list(tokens)], [0])
    plan = backend.plan(layout, target.config.attention_spec)
    return target(layout, kv, backend, plan, hidden_layers=layers).hidden_states


def test_multi_layer_features_equal_a_fresh_prefill_and_key_on_layers(
    stories_f32, distilled, tmp_path, monkeypatch
):
    chunks = distilled[:6]
    layers = eagle_feature_layers(stories_f32, EagleTrainConfig(**E3))
    assert layers == (1, 2, 3, 5)  # the head's layers, then h_N for the teacher's logits
    store = compute_features(stories_f32, chunks, tmp_path, batch_size=4, layers=layers, log=None)
    assert store.layers == layers and store.hidden.shape == (6, 64, 4 * 64)
    for i in (0, 5):
        torch.testing.assert_close(
            store.hidden[i], _prefill_states(stories_f32, chunks[i], layers), rtol=1e-5, atol=1e-5
        )
    calls = []
    monkeypatch.setattr(features_module, "_write_shard", lambda *a: calls.append(a))
    compute_features(stories_f32, chunks, tmp_path, batch_size=4, layers=layers, log=None)
    assert calls == []  # same target, chunks and layers: cached
    compute_features(stories_f32, chunks, tmp_path, batch_size=4, layers=(5,), log=None)
    assert len(calls) == 2  # other layers: recomputed
    with pytest.raises(ValueError, match="layers"):
        compute_features(stories_f32, chunks, tmp_path, layers=(6,), log=None)


@pytest.mark.parametrize("extra", [{}, E3], ids=["eagle1", "eagle3"])
def test_unrolled_steps_equal_the_causal_forward_of_the_drafted_sequence(
    stories_f32, e1_store, extra
):
    """Step i of anchor a is the last row of the sequence: committed rows 0..a, then the
    anchor's steps 1..i (each fed the previous step's output), as the proposer's tree has it."""
    head = new_eagle_head(stories_f32, EagleTrainConfig(**extra))
    tokens, hidden = e1_store.batch(torch.tensor([0, 3]))
    if extra:
        feature = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(0))
    else:
        feature = rms_norm(hidden.float(), stories_f32.norm.weight, 1e-5)
    anchors, steps = 60, 4
    with torch.no_grad():
        outs = unrolled_outputs(head, feature[:, :anchors], tokens[:, 1:], steps)
        torch.testing.assert_close(
            outs[0], head.forward_dense(feature[:, :anchors], tokens[:, 1 : anchors + 1])
        )
        for a in (0, 17, anchors - 1):
            feats = torch.cat([feature[:, : a + 1], *(o[:, a : a + 1] for o in outs[:-1])], dim=1)
            toks = tokens[:, 1 : a + steps + 1]
            ref = head.forward_dense(feats, toks)
            for i in range(1, steps):
                torch.testing.assert_close(outs[i][:, a], ref[:, a + i], rtol=1e-5, atol=1e-5)


def test_training_learns_beats_untrained_and_resumes_exactly(
    stories_f32, distilled, e1_store, tmp_path
):
    prompts = [c[:24] for c in distilled[-4:]]
    config = EagleTrainConfig(
        ttt_steps=3,
        steps=40,
        batch_size=8,
        lr=1e-2,
        warmup_steps=5,
        val_every=1000,
        checkpoint_every=20,
        token_loss_weight=1.0,
    )
    untrained = measure_eagle(
        new_eagle_head(stories_f32, config), stories_f32, prompts, max_new_tokens=32
    )
    full = train_eagle(stories_f32, e1_store, config, tmp_path / "full", log=None)
    first, last = full.history[0], full.history[-1]
    assert last["loss"] < 0.75 * first["loss"] and last["val_loss"] < 0.75 * first["loss"]
    assert last["top1_0"] > first["top1_0"] + 0.2
    trained = measure_eagle(full.head, stories_f32, prompts, max_new_tokens=32)
    assert trained["mean_accepted_length"] > untrained["mean_accepted_length"] + 0.2, (
        trained,
        untrained,
    )
    # Interrupt after 20 steps, resume to 40: the same weights as the uninterrupted run.
    train_eagle(stories_f32, e1_store, config, tmp_path / "split", stop_at=20, log=None)
    resumed = train_eagle(stories_f32, e1_store, config, tmp_path / "split", log=None)
    assert resumed.steps == 40 and len(resumed.history) == 40
    for (name, a), b in zip(full.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="other settings"):
        train_eagle(
            stories_f32, e1_store, attrs.evolve(config, noise=0.5), tmp_path / "split", log=None
        )
    assert not list((tmp_path / "split" / "checkpoint").glob("*.pt"))  # safetensors + JSON only


def test_eagle3_training_learns_over_its_draft_vocabulary(stories_f32, distilled, tmp_path):
    config = EagleTrainConfig(
        **E3, ttt_steps=3, steps=25, batch_size=8, lr=3e-3, warmup_steps=5, val_every=1000
    )
    store = compute_features(
        stories_f32,
        distilled[:-4],
        tmp_path / "f",
        layers=eagle_feature_layers(stories_f32, config),
        log=None,
    )
    result = train_eagle(stories_f32, store, config, tmp_path / "head", log=None)
    assert result.history[-1]["loss"] < 0.7 * result.history[0]["loss"]
    head = load_eagle_head(tmp_path / "head", stories_f32)
    ids = head.draft_to_target
    counts = torch.bincount(store.tokens.flatten(), minlength=512)
    assert (
        len(ids.unique()) == 300 and counts[ids].min() >= counts.sort(descending=True).values[299]
    )
    with pytest.raises(ValueError, match="layers"):
        train_eagle(
            stories_f32,
            compute_features(stories_f32, distilled[:12], tmp_path / "g", log=None),
            config,
            tmp_path / "x",
            log=None,
        )


def test_frozen_lm_head_stays_the_targets_rows(stories_f32, distilled, tmp_path):
    config = EagleTrainConfig(**E3, ttt_steps=2, steps=3, batch_size=4, lr=3e-3, warmup_steps=1,
                              val_every=1000, freeze_lm_head=True)  # fmt: skip
    store = compute_features(stories_f32, distilled[:16], tmp_path / "f",
                             layers=eagle_feature_layers(stories_f32, config), log=None)  # fmt: skip
    head = train_eagle(stories_f32, store, config, tmp_path / "head", log=None).head
    ids = head.draft_to_target
    assert torch.equal(head.lm_head.weight, stories_f32.lm_head.weight.float()[ids])
    assert torch.equal(head.norm.weight, stories_f32.norm.weight.float())
    trained = train_eagle(stories_f32, store, attrs.evolve(config, freeze_lm_head=False), tmp_path / "free",
                          log=None).head  # fmt: skip
    assert not torch.equal(trained.lm_head.weight, stories_f32.lm_head.weight.float()[ids])
    with pytest.raises(ValueError, match="freeze_lm_head"):
        EagleTrainConfig(freeze_lm_head=True)  # EAGLE-1


def test_eagle3_last_layer_init_passes_the_top_feature_to_the_last_layers_weights(stories_f32):
    n, hidden = stories_f32.config.num_layers, stories_f32.config.hidden_size
    config = EagleTrainConfig(kind=EagleKind.EAGLE3, target_layers=(3, n, 1), draft_vocab_size=300,
                              init_from_last_layer=True)  # fmt: skip
    head = new_eagle_head(stories_f32, config)
    x = torch.randn(5, 3 * hidden)  # [rows, 3H] in the order of target_layers
    assert torch.equal(head.target_feature(x), x[:, hidden : 2 * hidden])  # layer n, not the last slice
    src = stories_f32.layers[-1]
    qkv = head.layer.self_attn.qkv_proj.weight  # [q + 2 kv, 2H]
    assert torch.equal(qkv[:, hidden:], src.self_attn.qkv_proj.weight.float())
    assert qkv[:, :hidden].abs().sum() > 0  # the token half keeps its random init
    assert torch.equal(head.layer.mlp.down_proj.weight, src.mlp.down_proj.weight.float())
    assert torch.equal(head.layer.hidden_norm.weight, src.input_layernorm.weight.float())
    # With the token half silenced, the head's step is the target's last layer on its top
    # feature: one row attends only to itself, so attention is its own V.
    with torch.no_grad():
        qkv[:, :hidden].zero_()
    h = torch.randn(1, 1, hidden)
    out = head.forward_dense(head.target_feature(torch.cat((0 * h, h, 0 * h), dim=-1)), torch.tensor([[5]]))
    attn = src.self_attn
    v = src.self_attn.qkv_proj(src.input_layernorm(h))[..., attn.q_size + attn.kv_size :]
    v = v.view(1, 1, attn.num_kv_heads, attn.head_dim).repeat_interleave(
        attn.num_heads // attn.num_kv_heads, dim=2).reshape(1, 1, attn.q_size)  # fmt: skip
    mid = h + attn.o_proj(v)
    ref = mid + src.mlp(src.post_attention_layernorm(mid))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bad_training_config(stories_f32):
    with pytest.raises(ValueError, match="steps"):
        EagleTrainConfig(steps=0)
    with pytest.raises(ValueError, match="ttt_steps"):
        EagleTrainConfig(ttt_steps=0)
    with pytest.raises(ValueError, match="step_weight"):
        EagleTrainConfig(step_weight=1.5)
    with pytest.raises(ValueError, match="noise"):
        EagleTrainConfig(noise=-0.1)
    with pytest.raises(ValueError, match="target_layers"):
        EagleTrainConfig(kind=EagleKind.EAGLE3, target_layers=())
    with pytest.raises(ValueError, match="draft_vocab_size is for EAGLE-3"):
        EagleTrainConfig(draft_vocab_size=100)
    with pytest.raises(TypeError, match="kind"):
        EagleTrainConfig(kind="eagle1")
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..512"):
        eagle_feature_layers(stories_f32, EagleTrainConfig(**{**E3, "draft_vocab_size": 600}))
    with pytest.raises(
        ValueError, match="N >= 7"
    ):  # 5 layers: the reference's default is not 3 layers
        eagle_feature_layers(stories_f32, EagleTrainConfig(kind=EagleKind.EAGLE3))
    with pytest.raises(TypeError, match="features"):
        train_eagle(stories_f32, "not a store", EagleTrainConfig(), "/tmp/never")


def test_cli_trains_a_head_that_generates_exactly(stories_path, tmp_path, capsys):
    out = tmp_path / "head"
    rc = main(
        [
            "train-eagle",
            "--target",
            str(stories_path),
            "--out",
            str(out),
            "--self-distill",
            "24",
            "--distill-tokens",
            "128",
            "--chunk-len",
            "64",
            "--steps",
            "12",
            "--batch-size",
            "4",
            "--ttt-steps",
            "2",
            "--val-every",
            "6",
            "--dtype",
            "float32",
            "--val-tokens",
            "16",
            "--top-k",
            "2",
            "--depth",
            "3",
            "--num-verify-tokens",
            "4",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and set(summary["held_out_acceptance"]) == {
        "tree",
        "chain k=1",
        "chain k=3",
    }
    assert summary["held_out_acceptance"]["tree"]["mean_accepted_length"] >= 1.0
    assert (
        "val_mean_accepted_length" in json.loads((out / "train_log.json").read_text())["history"][5]
    )
    assert "held-out greedy tree" in capsys.readouterr().out
    eagle = EAGLETree.from_pretrained(out, top_k=2, depth=3, num_verify_tokens=4)
    _assert_greedy_equals_plain(stories_path, eagle, 4)
    bad = ["train-eagle", "--target", str(stories_path), "--out", str(out), "--ttt-steps", "0"]
    with pytest.raises(SystemExit):
        main(bad)
    capsys.readouterr()
    bad_steps = [
        "train-eagle",
        "--target",
        str(stories_path),
        "--out",
        str(out),
        "--steps",
        "0",
        "--self-distill",
        "2",
    ]
    assert main(bad_steps) == 2
    assert "steps must be >= 1" in capsys.readouterr().err


def _assert_greedy_equals_plain(stories_path, proposer, nodes):
    gen = Generator.from_pretrained(
        stories_path, dtype="float32", proposer=proposer, policy=FixedPolicy(nodes)
    )
    plain = Generator.from_pretrained(stories_path, dtype="float32")
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog"]
    assert [o.token_ids for o in gen.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]
    return gen.metrics


def test_bundled_head_generates_exactly_and_accepts_long_paths(stories_path):
    head_dir = bundled_model_path().parent / "stories260K-eagle"
    eagle = EAGLETree.from_pretrained(head_dir, top_k=4, depth=5, num_verify_tokens=16)
    m = _assert_greedy_equals_plain(stories_path, eagle, 16)
    assert m.num_emitted_in_verify / m.num_verify_steps > 2.0
    chain = EAGLETree.from_pretrained(head_dir, chain_tree(3))
    _assert_greedy_equals_plain(stories_path, chain, 3)
    assert (
        json.loads((head_dir / "summary.json").read_text())["held_out_acceptance"]["tree"][
            "mean_accepted_length"
        ]
        > 2.0
    )
