"""MTP training pipeline: data chunks, cached features, the trainer (it learns, it resumes
exactly), and the CLI end to end on stories260K."""

from __future__ import annotations

import json
from types import SimpleNamespace

import attrs
import pytest
import torch

from specdec import Generator, SamplingParams
from specdec.cli import main
from specdec.codec import load_tokenizer
from specdec.models.loading import load_model
from specdec.proposers import MTPHead
from specdec.training import (
    MTPTrainConfig,
    TrainData,
    build_chunks,
    compute_features,
    read_prompts,
    text_files,
    token_chunks,
    train_mtp,
)
from specdec.training import features as features_module
from specdec.training.data import default_distill_batch, pack_chunks
from specdec.training.mtp import measure_acceptance, new_head


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 50 for c in text]


def test_text_files_and_chunks(tmp_path):
    (tmp_path / "a.py").write_text("abcdefghij")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("klmnop")
    (tmp_path / "c.bin").write_bytes(b"\xff\xfe")
    texts = text_files([tmp_path])
    assert texts == ["abcdefghij", "klmnop"]
    chunks = token_chunks(CharTokenizer(), texts, chunk_len=4, separator_id=49)
    # 10 + 1 + 6 + 1 = 18 tokens -> 4 chunks of 4, the last 2 dropped; 49 separates texts.
    stream = [ord(c) % 50 for c in "abcdefghij"] + [49] + [ord(c) % 50 for c in "klmnop"] + [49]
    assert chunks == [stream[0:4], stream[4:8], stream[8:12], stream[12:16]]
    assert chunks[2][2] == 49  # the separator after the first text (token 10 of the stream)
    assert len(token_chunks(CharTokenizer(), texts, chunk_len=4, max_chunks=2)) == 2
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        text_files([tmp_path / "nothing-here*.py"])
    with pytest.raises(ValueError, match="chunk_len"):
        token_chunks(CharTokenizer(), texts, chunk_len=1)


@pytest.fixture(scope="module")
def stories_f32(stories_path):
    target, _, _ = load_model(stories_path, dtype="float32")
    return target


@pytest.fixture(scope="module")
def distilled(stories_path, stories_f32):
    """The target's own sampled stories, cut into 64-token chunks."""
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    params = [SamplingParams(max_new_tokens=256, temperature=1.0, seed=i, ignore_eos=True) for i in range(48)]
    outs = gen.generate([[1]] * 48, params)
    seqs = [[1, *o.token_ids] for o in outs]
    return [s[j : j + 64] for s in seqs for j in range(0, 257 - 64, 64)], gen.tokenizer


def test_features_equal_the_target_forward_and_are_cached(stories_f32, distilled, tmp_path, monkeypatch):
    chunks = distilled[0][:10]
    store = compute_features(stories_f32, chunks, tmp_path, batch_size=4, log=None)
    assert len(store) == 10 and store.hidden.shape == (10, 64, stories_f32.config.hidden_size)
    for i in (0, 7):  # each chunk alone through a fresh plain prefill
        alone = features_module.batch_hidden_states(stories_f32, [chunks[i]])[0]
        torch.testing.assert_close(store.hidden[i], alone, rtol=1e-5, atol=1e-5)
    calls = []
    monkeypatch.setattr(features_module, "_write_shard", lambda *a: calls.append(a))
    compute_features(stories_f32, chunks, tmp_path, batch_size=4, log=None)
    assert calls == []  # same target and chunks: served from the cache
    compute_features(stories_f32, chunks[:9], tmp_path, batch_size=4, log=None)  # other data
    assert len(calls) == 3  # recomputed, every shard


def test_training_learns_and_resumes_exactly(stories_f32, distilled, tmp_path):
    chunks, tokenizer = distilled
    store = compute_features(stories_f32, chunks, tmp_path / "features", log=None)
    prompts = [c[:24] for c in chunks[-4:]]
    config = MTPTrainConfig(steps=60, batch_size=8, lr=3e-3, warmup_steps=10, val_every=1000, checkpoint_every=30)
    untrained = measure_acceptance(new_head(stories_f32, config), stories_f32, prompts, max_new_tokens=32)
    full = train_mtp(stories_f32, store, config, tmp_path / "full", log=None)
    hist = full.history
    assert hist[-1]["token"] < hist[0]["token"] and hist[-1]["hidden"] < hist[0]["hidden"]
    trained = measure_acceptance(full.head, stories_f32, prompts, max_new_tokens=32)
    assert trained["acceptance_rate"] > untrained["acceptance_rate"] + 0.05, (trained, untrained)
    # Interrupt after 30 steps, resume to 60: the same weights as the uninterrupted run.
    train_mtp(stories_f32, store, config, tmp_path / "split", stop_at=30, log=None)
    resumed = train_mtp(stories_f32, store, config, tmp_path / "split", log=None)
    assert resumed.steps == 60
    for (name, a), b in zip(full.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="other settings"):
        train_mtp(stories_f32, store, attrs_evolve(config, lr=1e-2), tmp_path / "split", log=None)


def attrs_evolve(config, **changes):
    import attrs

    return attrs.evolve(config, **changes)


def test_train_data_held_out_prompts_and_bad_input(stories_f32, tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij" * 40)  # 400 tokens -> 12 chunks of 32
    data = TrainData(files=[tmp_path / "a.txt"], chunk_len=32)
    chunks, prompts = build_chunks(stories_f32, CharTokenizer(), data)
    assert len(chunks) == 12 - 8 and all(len(c) == 32 for c in chunks)  # the last 8 are held out
    assert len(prompts) == 8 and all(len(p) == 32 for p in prompts)  # their beginnings (<= 48 tokens)
    custom = attrs.evolve(data, val_prompts=["x", [1, 2]])
    assert build_chunks(stories_f32, CharTokenizer(), custom)[1] == ["x", [1, 2]]
    with pytest.raises(ValueError, match="files .* or self_distill_samples"):
        TrainData()
    for bad in (dict(chunk_len=1), dict(max_chunks=0), dict(val_tokens=-2), dict(self_distill_samples=-1),
                dict(distill_tokens=0), dict(max_bytes=True), dict(distill_batch_size=0),
                dict(distill_temperature="hot"), dict(distill_temperature=-0.5), dict(distill_stop_at_eos="yes")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TrainData(files=["a"], **bad)
    with pytest.raises(ValueError, match="only 4 chunks"):
        build_chunks(stories_f32, CharTokenizer(), attrs.evolve(data, chunk_len=100))


def test_self_distill_stopping_at_eos_packs_seeded_generations(stories_f32, stories_path):
    tokenizer = load_tokenizer(stories_path)
    prompts = ["Once upon a time", [1, 403, 300], "The dog"]  # text and token ids may mix
    data = TrainData(self_distill_samples=14, distill_prompts=prompts, distill_tokens=40, distill_temperature=0.8,
                     distill_stop_at_eos=True, chunk_len=48, distill_batch_size=3)  # fmt: skip
    chunks, held_out = build_chunks(stories_f32, tokenizer, data)
    stream = [t for c in [*chunks, *held_out] for t in c]
    assert len(chunks) >= 2 and all(len(c) == 48 for c in chunks)  # packed: chunks cross generations
    first = tokenizer.encode("Once upon a time")
    assert stream[: len(first)] == first  # the first generation starts the stream
    assert 1 in stream[len(first) + 1 :]  # a later generation's BOS: they were joined, not cut one by one
    # each sample has its own seed, so the batch that ran it does not change what it generated
    for batch in (1, 8, None):
        assert build_chunks(stories_f32, tokenizer, attrs.evolve(data, distill_batch_size=batch))[0] == chunks


def test_default_distill_batch_follows_the_model_and_device(stories_f32):
    assert default_distill_batch(stories_f32) == 64  # a tiny model: its steps are overhead a batch shares
    big = [torch.empty(100_000_000, device="meta")]
    assert default_distill_batch(SimpleNamespace(device=torch.device("cpu"), parameters=lambda: big)) == 16
    assert default_distill_batch(SimpleNamespace(device=torch.device("meta"), parameters=lambda: big)) == 64


def test_pack_separates_sequences_once_and_cuts_exact_chunks():
    assert pack_chunks([[5, 6, 2], [7, 8, 9], [], [3]], chunk_len=3, separator_id=2) == [[5, 6, 2], [7, 8, 9], [2, 3, 2]]
    assert pack_chunks([[5, 6, 2], [7]], chunk_len=2, separator_id=2) == [[5, 6], [2, 7]]  # no second separator after 2
    assert pack_chunks([[5, 6], [7]], chunk_len=2, separator_id=None) == [[5, 6]]


def test_read_prompts_accepts_text_ids_and_objects(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('"def f():"\n\n[1, 2, 3]\n{"prompt": "x = 1"}\n{"prompt": [4]}\n')
    assert read_prompts(path) == ["def f():", [1, 2, 3], "x = 1", [4]]
    for text, why in (('"a"\n{"text": "b"}\n', ":2: a prompt must be"), ('"a"\nnot json\n', ":2: not JSON"),
                      ('""\n', ":1: a prompt must be"), ("[1, -2]\n", ":1: a prompt"), ("[true]\n", ":1: a prompt"),
                      ("\n", "holds no prompt")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            read_prompts(path)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_prompts(tmp_path / "missing.jsonl")


def test_bad_training_config():
    with pytest.raises(ValueError, match="steps"):
        MTPTrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr"):
        MTPTrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match="vocab"):
        MTPTrainConfig(vocab="some")
    with pytest.raises(TypeError, match="features"):
        train_mtp(None, "not a store", MTPTrainConfig(), "/tmp/never")


def test_cli_trains_a_head_that_generates_exactly(stories_path, tmp_path, capsys):
    out = tmp_path / "head"
    (tmp_path / "prompts.jsonl").write_text('"Once upon a time"\n{"prompt": [1, 450]}\n')
    rc = main([
        "train-mtp", "--target", str(stories_path), "--out", str(out), "--self-distill", "24",
        "--distill-tokens", "128", "--chunk-len", "64", "--steps", "20", "--batch-size", "4",
        "--val-every", "10", "--dtype", "float32", "--val-tokens", "16", "--distill-prompt", "The cat",
        "--distill-prompts", str(tmp_path / "prompts.jsonl"), "--distill-temperature", "0.9",
        "--distill-batch-size", "5", "--distill-stop-at-eos",
    ])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["distill_prompts"] == ["The cat", "Once upon a time", [1, 450]]
    assert summary["data"]["distill_temperature"] == 0.9 and summary["data"]["distill_stop_at_eos"] is True
    assert summary["steps"] == 20 and set(summary["held_out_acceptance"]) == {"k=1", "k=2", "k=3"}
    assert "val_acceptance_rate" in json.loads((out / "train_log.json").read_text())["history"][9]
    assert "held-out greedy k=1" in capsys.readouterr().out
    proposer = MTPHead.from_pretrained(out, num_speculative_tokens=2)
    gen = Generator.from_pretrained(stories_path, dtype="float32", proposer=proposer)
    plain = Generator.from_pretrained(stories_path, dtype="float32")
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    assert gen.generate("Once upon a time", params).token_ids == plain.generate("Once upon a time", params).token_ids
    with pytest.raises(SystemExit):
        main(["train-mtp", "--target", str(stories_path), "--out", str(out), "--vocab", "bad"])
    capsys.readouterr()
    bad_steps = ["train-mtp", "--target", str(stories_path), "--out", str(out), "--steps", "0", "--self-distill", "2"]
    assert main(bad_steps) == 2  # one line on stderr, exit status 2
    assert "steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps"):
        main(["--debug", *bad_steps])
