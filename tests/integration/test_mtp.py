"""MTP head and proposer: paged == dense, drafts == a from-scratch reference, greedy exactness,
save/load, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_head, random_prompts, record_drafts

from specdec import Generator, SamplingParams
from specdec.models.loading import load_model
from specdec.models.mtp_head import MTPModule as MTPHeadModel
from specdec.models.mtp_head import load_mtp_head, save_mtp_head
from specdec.proposers import MTPHead

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    return random_prompts(vocab, n, seed, max_len=25)


@pytest.fixture(scope="module")
def tiny_target(tiny_checkpoint):
    target, _, _ = load_model(tiny_checkpoint("qwen2"), dtype="float64")
    return target


def _target_hidden(target, tokens: list[int]) -> torch.Tensor:
    """[len, hidden] the target's last hidden states over ``tokens`` (a fresh plain prefill)."""
    gen = Generator.from_components(target)
    kv = gen.engine.target_kv
    kv.manager.add_sequence(0)
    kv.manager.reserve(0, len(tokens))
    layout = kv.layout([0], [tokens], [0])
    plan = gen.engine.backend.plan(layout, target.config.attention_spec)
    out = target(layout, kv, gen.engine.backend, plan, return_hidden=True)
    return out.hidden_states


def reference_drafts(head: MTPHeadModel, target, history: list[int], k: int) -> list[int]:
    """Greedy drafts from scratch: target hidden states of the committed prefix, the head's
    dense forward over all pairs, then k - 1 self-fed positions."""
    n = len(history)
    h = _target_hidden(target, history[:-1])  # h_0 .. h_{n-2}
    hidden = list(h)
    nxt = history[1:]  # t_1 .. t_{n-1}
    drafts = []
    for _ in range(k):
        g = head.forward_dense(torch.stack(hidden)[None], torch.tensor(nxt)[None])[0]  # [pairs, H]
        tok = int(head.logits(g[-1:]).argmax(-1))
        drafts.append(tok)
        hidden.append(g[-1])
        nxt.append(tok)
    assert len(drafts) == k and n >= 1
    return drafts


def test_paged_forward_matches_dense(tiny_target):
    """The head's paged forward (ragged batch, pages out of order) equals forward_dense."""
    head = random_head(tiny_target, 1)
    gen = Generator.from_components(tiny_target, proposer=MTPHead.from_model(head))
    kv, backend = gen.engine.proposer_kv, gen.engine.backend
    lengths = [7, 1, 12]
    g = torch.Generator().manual_seed(0)
    hid = [torch.randn(n, 64, generator=g, dtype=torch.float64) for n in lengths]
    toks = [torch.randint(0, 103, (n,), generator=g).tolist() for n in lengths]
    for s in (5, 3, 9):
        kv.manager.add_sequence(s)
    for s, n in zip((5, 3, 9), lengths):  # interleaved reservations scatter the pages
        kv.manager.reserve(s, n)
    layout = kv.layout([5, 3, 9], toks, [0, 0, 0])
    plan = backend.plan(layout, tiny_target.config.attention_spec)
    paged = head(torch.cat(hid), layout.token_ids, layout.positions, kv, backend, plan)
    dense = torch.cat([head.forward_dense(h[None], torch.tensor(t)[None])[0] for h, t in zip(hid, toks)])
    torch.testing.assert_close(paged, dense, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_proposer_drafts_match_reference(tiny_target, k):
    """Every draft the proposer makes inside the engine equals the from-scratch reference,
    so the KV re-run after each verify step, the left shift and the self-feeding are right."""
    head = random_head(tiny_target, 2)
    proposer = MTPHead.from_model(head, num_speculative_tokens=k)
    seen = []
    original = proposer.propose

    def recording(ctx):
        out = original(ctx)
        drafts = out.draft_token_ids.tolist()
        for tokens, row, n in zip(ctx.token_ids, drafts, out.num_draft_tokens):
            seen.append((list(tokens), row[:n], ctx.num_speculative_tokens))
        return out

    proposer.propose = recording
    gen = Generator.from_components(tiny_target, proposer=proposer, policy=k)  # fixed k: always drafts
    gen.generate(_prompts(103, 3, seed=k), SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert len(seen) >= 6
    for history, drafts, width in seen:
        assert drafts == reference_drafts(head, tiny_target, history, width)[: len(drafts)]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_mtp_greedy_exact_tiny_float64(tiny_target, k):
    head = random_head(tiny_target, 3)
    prompts = _prompts(103, 5, seed=10 + k)
    plain = Generator.from_components(tiny_target).generate(prompts, GREEDY)
    gen = Generator.from_components(tiny_target, proposer=MTPHead.from_model(head, num_speculative_tokens=k), policy=k)
    spec = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert gen.metrics.num_drafted > 0
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


@pytest.mark.parametrize("threshold", [0.1, 0.3])
def test_mtp_with_a_confidence_threshold_is_greedy_exact(tiny_target, threshold):
    """Chains that end after a draft the head hesitates on (k = 4 a ceiling), ending at
    different steps within one batch: the same output as plain decoding, chains of several
    lengths, proposals no wider than the steps taken, and no page left behind."""
    head = random_head(tiny_target, 3)
    prompts = _prompts(103, 6, seed=21)
    plain = Generator.from_components(tiny_target).generate(prompts, GREEDY)
    proposer = MTPHead.from_model(head, num_speculative_tokens=4, confidence_threshold=threshold)
    widths = []
    real = proposer.propose

    def recording(ctx):
        out = real(ctx)
        widths.append((out.width, max(out.num_draft_tokens)))
        return out

    proposer.propose = recording
    gen = Generator.from_components(tiny_target, proposer=proposer, policy=4)
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    drafted = gen.metrics.drafted_per_position
    assert drafted[0] > drafted[-1] and len(set(drafted)) > 2, drafted  # chains of many lengths
    assert all(width == longest for width, longest in widths)  # drafting stopped when all ended
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


def test_mtp_confidence_threshold_is_checked(tiny_target):
    with pytest.raises(ValueError, match=r"confidence_threshold must be in \[0, 1\), got 1.0"):
        MTPHead.from_pretrained("no-such-head", confidence_threshold=1.0)
    with pytest.raises(ValueError, match=r"confidence_threshold must be in \[0, 1\), got -0.5"):
        MTPHead.from_model(random_head(tiny_target, 3), confidence_threshold=-0.5)


def test_mtp_greedy_exact_inside_sampled_batch(tiny_target):
    head = random_head(tiny_target, 4)
    prompts = _prompts(103, 4, seed=7)
    plain = Generator.from_components(tiny_target).generate(prompts[:2], GREEDY)
    gen = Generator.from_components(tiny_target, proposer=MTPHead.from_model(head, num_speculative_tokens=3), policy=3)
    sampled = SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    outs = gen.generate(prompts, [GREEDY, GREEDY, sampled, sampled])
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in plain]
    # The sampled rows are the same seeded requests' plain output (a seed pins the tokens).
    plain_sampled = Generator.from_components(tiny_target).generate(prompts[2:], sampled)
    assert [o.token_ids for o in outs[2:]] == [o.token_ids for o in plain_sampled]
    assert gen.metrics.num_drafted > 0


def test_mtp_greedy_exact_stories_float32(stories_path):
    target, _, _ = load_model(stories_path, dtype="float32")
    head = random_head(target, 5, scale=0.5)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They"]
    plain_gen = Generator.from_pretrained(stories_path, dtype="float32")
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = plain_gen.generate(prompts, params)
    for k in (1, 3):
        gen = Generator.from_components(
            target, plain_gen.tokenizer, proposer=MTPHead.from_model(head, num_speculative_tokens=k), policy=k
        )
        assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in plain]


def test_save_load_roundtrip(tiny_target, tmp_path):
    head = random_head(tiny_target, 6, use_input_norms=False)
    save_mtp_head(head, tmp_path / "head")
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["use_input_norms"] is False
    from safetensors import safe_open

    with safe_open(str(tmp_path / "head" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert not any("embed" in n or "lm_head" in n for n in names)  # borrowed, never copied
    assert "enorm.weight" in names  # present (unused) so a file's layout never depends on the flag
    loaded = load_mtp_head(tmp_path / "head", tiny_target)
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    t = torch.randint(0, 103, (1, 5))
    torch.testing.assert_close(loaded.forward_dense(x, t), head.forward_dense(x, t))
    proposer = MTPHead.from_pretrained(tmp_path / "head", num_speculative_tokens=2)
    gen = Generator.from_components(tiny_target, proposer=proposer, policy=2)
    prompts = _prompts(103, 2, seed=1)
    plain = Generator.from_components(tiny_target).generate(prompts, GREEDY)
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [o.token_ids for o in plain]


def test_input_norm_flag_changes_the_math(tiny_target):
    a = random_head(tiny_target, 7, use_input_norms=True)
    b = random_head(tiny_target, 7, use_input_norms=False)
    x, t = 5 * torch.randn(1, 4, 64, dtype=torch.float64), torch.randint(0, 103, (1, 4))
    assert not torch.allclose(a.forward_dense(x, t), b.forward_dense(x, t))


def test_bad_input(tiny_target, tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        MTPHead.from_model(random_head(tiny_target), num_speculative_tokens=0)
    with pytest.raises(FileNotFoundError, match="config.json"):
        MTPHead.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "something-else"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="MTP head config"):
        MTPHead.from_pretrained(tmp_path)
    save_mtp_head(random_head(tiny_target), tmp_path / "head")
    other, _, _ = load_model(tiny_checkpoint("llama"), dtype="float64")
    proposer = MTPHead.from_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match="does not fit this target"):
        Generator.from_components(other, proposer=proposer)


@pytest.mark.usefixtures("kernel")
def test_a_packed_bf16_head_saves_as_plain_weights(stories_path, tmp_path):
    from specdec.models.packed import pack_linears

    target, _, _ = load_model(stories_path, dtype="bfloat16", pack=False)
    head = random_head(target, 8)
    reference = {k: v.clone() for k, v in head.state_dict().items()}
    save_mtp_head(pack_linears(head), tmp_path / "head")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert set(saved) == set(reference)
    for name, value in reference.items():
        assert torch.equal(saved[name], value), name


def test_draft_vocabulary_subset_is_exact_and_only_drafts_from_it(tiny_target, tmp_path):
    from specdec.models.mtp_head import save_draft_vocab

    head = random_head(tiny_target, 9)
    subset = torch.tensor([5, 17, 3, 40, 99, 60, 2, 81])
    proposer = MTPHead.from_model(head, num_speculative_tokens=3, draft_vocab=subset)
    drafted = record_drafts(proposer)
    prompts = _prompts(103, 4, seed=3)
    plain = Generator.from_components(tiny_target).generate(prompts, GREEDY)
    gen = Generator.from_components(tiny_target, proposer=proposer, policy=3)
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    sampled = SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    gen.generate(prompts, sampled)
    assert drafted and set(drafted) <= set(subset.tolist())
    # From a directory: the most frequent ids first, cut at draft_vocab_size.
    save_mtp_head(head, tmp_path / "head")
    save_draft_vocab(tmp_path / "head", subset)
    loaded = MTPHead.from_pretrained(tmp_path / "head", draft_vocab_size=3)
    Generator.from_components(tiny_target, proposer=loaded)
    assert loaded._draft_vocab.tolist() == [5, 17, 3]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        MTPHead.from_pretrained(tmp_path / "head", draft_vocab_size=0)
