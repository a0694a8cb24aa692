"""CrossTokenizerDraft: a draft model of another tokenizer drafts through text.

Two token spaces, both offline: the bundled stories260K tokenizer (the target's) and a coarser
one derived from it (its last merges dropped, so words split into more pieces; its ids
renumbered), with the draft model being stories260K itself seen through that tokenizer (its
embedding rows gathered for the derived vocabulary). The draft then reads the text in other
pieces than the target does and writes it back in its own: some drafts are accepted, some not,
and greedy output must be the target's own. At T > 0 the engine's output distribution is
checked with the chi-square statistics of test_lossless_engine (a 12-word vocabulary, the
draft tokenizer the same words under other ids), with a negative control.
"""

from __future__ import annotations

import json
import sys

import attrs
import pytest
import torch
from helpers import word_tokenizer

from specdec import FixedPolicy, Generator, SamplingParams
from specdec.models.llama import LlamaModel
from specdec.models.loading import load_model
from specdec.proposers import CrossTokenizerDraft, DraftModel
from specdec.proposers.cross_tokenizer import decode_after, encode_after


def coarser_tokenizer(path, keep_merges: int):
    """The tokenizer of ``path`` with only its first ``keep_merges`` BPE merges (the tokens the
    others made removed, unless a kept merge uses them), non-byte ids in reverse order, and
    the target's token string of each of its ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((path / "tokenizer.json").read_text())
    model = spec["model"]
    merges = model["merges"][:keep_merges]
    used = {t for a, b in merges for t in (a, b, a + b)}
    removed = {a + b for a, b in model["merges"][keep_merges:]} - used
    tokens = [
        t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in removed
    ]
    order = tokens[:259] + tokens[259:][::-1]  # <unk>, <s>, </s> and the 256 bytes keep their ids
    model["vocab"] = {t: i for i, t in enumerate(order)}
    model["merges"] = merges
    backend = Tokenizer.from_str(json.dumps(spec))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return tok, order


def model_in_vocabulary(model: LlamaModel, rows: list[int]) -> LlamaModel:
    """``model`` whose token ``i`` is its token ``rows[i]`` (embedding and LM head gathered)."""
    index = torch.tensor(rows)
    state = {
        name: t[index] if name in ("embed_tokens.weight", "lm_head.weight") else t
        for name, t in model.state_dict().items()
    }
    out = LlamaModel(attrs.evolve(model.config, vocab_size=len(rows))).to(model.dtype)
    out.load_state_dict(state)
    return out.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def stories(stories_path):
    """(target, its tokenizer, the draft model, the draft's tokenizer)."""
    from transformers import AutoTokenizer

    target, _, _ = load_model(stories_path, dtype="float32")
    target_tok = AutoTokenizer.from_pretrained(str(stories_path))
    draft_tok, order = coarser_tokenizer(stories_path, keep_merges=100)
    vocab = target_tok.get_vocab()
    draft = model_in_vocabulary(target, [vocab[t] for t in order])
    return target, target_tok, draft, draft_tok


PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "Mom said"]


def test_the_two_tokenizers_differ(stories):
    _, target_tok, _, draft_tok = stories
    text = "Once upon a time, there was a little girl named Lily."
    assert len(draft_tok) < len(target_tok)
    assert len(draft_tok(text)["input_ids"]) > len(target_tok(text)["input_ids"])
    assert draft_tok.decode(draft_tok(text)["input_ids"], skip_special_tokens=True) == text


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_output_is_the_targets(stories, k):
    target, target_tok, draft, draft_tok = stories
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    plain = Generator.from_components(target, target_tok).generate(PROMPTS, params)
    proposer = CrossTokenizerDraft(draft, draft_tok, num_speculative_tokens=k)
    gen = Generator.from_components(target, target_tok, proposer=proposer, policy=FixedPolicy(k))
    spec = gen.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    m = gen.metrics
    assert 0 < m.num_accepted < m.num_drafted, (m.num_accepted, m.num_drafted)
    assert m.acceptance_rate > 0.15, m.acceptance_rate
    assert proposer.num_full_encodes == 0  # the look-behind window held at every boundary
    assert proposer.num_live_sequences == 0  # every request's state freed
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]


def test_preempted_requests_start_again_and_free_their_state(stories):
    from specdec import CacheConfig

    target, target_tok, draft, draft_tok = stories
    proposer = CrossTokenizerDraft(draft, draft_tok, num_speculative_tokens=3)
    # Few pages: running requests are preempted and start again from their prompts.
    gen = Generator.from_components(
        target, target_tok, proposer=proposer, policy=FixedPolicy(3),
        cache_config=CacheConfig(max_batch_size=4, page_size=4, num_pages=40, max_model_len=90),
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    plain = Generator.from_components(target, target_tok).generate(PROMPTS, params)
    assert [o.token_ids for o in gen.generate(PROMPTS, params)] == [o.token_ids for o in plain]
    assert gen.scheduler.num_preemptions > 0
    assert proposer.num_live_sequences == 0
    assert (
        proposer._kv_manager.allocator.num_free_pages
        == proposer._kv_manager.allocator.num_total_pages
    )


def test_the_same_tokenizer_through_text_is_fully_accepted(stories):
    """An oracle: the target drafting for itself through text (its own tokenizer taken as
    foreign) proposes what the target says, but for a token cut by the guard."""
    target, target_tok, _, _ = stories
    proposer = CrossTokenizerDraft(target, target_tok, num_speculative_tokens=4)
    gen = Generator.from_components(target, target_tok, proposer=proposer, policy=FixedPolicy(4))
    gen.generate(PROMPTS, SamplingParams(max_new_tokens=48, ignore_eos=True))
    assert gen.metrics.acceptance_rate > 0.95, gen.metrics.acceptance_rate


def test_boundaries(stories):
    _, target_tok, _, _ = stories
    # A merge across the boundary ("▁time" out of "ti" + "me") is refused ...
    assert encode_after(target_tok, "Once upon a ti", "me there") is None
    # ... and a clean one continues without the dummy prefix SentencePiece puts on a first word.
    ids, ends = encode_after(target_tok, "Once upon a", " time, there")
    assert target_tok.convert_ids_to_tokens(ids) == ["▁time", ",", "▁there"] and ends == [5, 6, 12]
    ids = target_tok("Once upon a time", add_special_tokens=False)["input_ids"]
    assert decode_after(target_tok, ids, 2, 2) == " a time"  # the leading space kept


def test_bad_input_names_the_argument(stories):
    target, target_tok, draft, draft_tok = stories
    with pytest.raises(TypeError, match="draft_tokenizer must be a transformers tokenizer"):
        CrossTokenizerDraft(draft, "not a tokenizer")
    # The draft's tokenizer has more tokens than the draft model has rows: not its tokenizer.
    with pytest.raises(
        ValueError, match="draft_tokenizer has 512 tokens but its model's embedding has only 458"
    ):
        CrossTokenizerDraft(draft, target_tok)
    with pytest.raises(TypeError, match="draft must be a DraftModel"):
        CrossTokenizerDraft(object(), draft_tok)
    with pytest.raises(TypeError, match="from_pretrained"):
        CrossTokenizerDraft("path/to/draft", draft_tok)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        CrossTokenizerDraft(draft, draft_tok, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="look_behind"):
        CrossTokenizerDraft(draft, draft_tok, look_behind=0)
    with pytest.raises(TypeError, match="target_tokenizer must be a transformers tokenizer"):
        CrossTokenizerDraft(draft, draft_tok, target_tokenizer=42)
    # No target tokenizer anywhere: refused when the generator is built.
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        Generator.from_components(target, None, proposer=CrossTokenizerDraft(draft, draft_tok))
    # The plain draft path refuses the foreign draft and names the wrapper.
    with pytest.raises(ValueError, match="CrossTokenizerDraft"):
        Generator.from_components(
            target, target_tok, proposer=DraftModel.from_model(draft, tokenizer=draft_tok)
        )


# ---- T > 0: the engine's output distribution -----------------------------------------------------

VOCAB = 12
PERMUTATION = [5, 11, 0, 7, 2, 9, 4, 1, 10, 3, 8, 6]  # target token i is draft token PERMUTATION[i]


def _word_draft_tokenizer():
    """The target's 12 words ``t0 .. t11`` under other ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(
        models.WordLevel({f"t{i}": PERMUTATION[i] for i in range(VOCAB)}, unk_token="t0")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _cross_proposer(models, k: int, cls=CrossTokenizerDraft):
    rows = [PERMUTATION.index(j) for j in range(VOCAB)]  # draft token j is target token rows[j]
    draft = model_in_vocabulary(models[2], rows)
    return cls(
        draft,
        _word_draft_tokenizer(),
        num_speculative_tokens=k,
        target_tokenizer=word_tokenizer(VOCAB),
    )


class ClaimsUniformDrafts(CrossTokenizerDraft):
    """Bug: the drafts reported as drawn from a uniform distribution, although they are the
    draft's deterministic choice (the verifier then accepts them too often)."""

    def propose(self, ctx):
        out = super().propose(ctx)
        probs = torch.full((*out.draft_token_ids.shape, VOCAB), 1.0 / VOCAB, dtype=torch.float64)
        return attrs.evolve(out, draft_probs=probs)


@pytest.fixture(scope="module")
def lossless(monkeypatch_module):
    import test_lossless_engine as lossless

    monkeypatch_module.setattr(lossless, "BATCH", 512)
    return lossless


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def word_models(lossless):
    return lossless.build_models()


@pytest.mark.parametrize(
    ("sampling", "mode"), [("t1.0", "stream"), ("t0.8-topk8-topp0.9", "seeded")]
)
def test_sampled_output_matches_the_target_distribution(
    lossless, word_models, monkeypatch, sampling, mode
):
    monkeypatch.setattr(lossless, "_proposer", lambda models, kind, k: _cross_proposer(models, k))
    case = lossless.Case(sampling, 3, "cross", mode)
    result, gen = lossless.run_case(word_models, case)
    assert min(result.values()) > lossless.ALPHA, result
    m = gen.metrics
    assert 0.02 < m.acceptance_rate < 0.95, m.acceptance_rate
    assert gen.proposer.num_live_sequences == 0


def test_the_check_rejects_drafts_claimed_to_be_uniform(lossless, word_models, monkeypatch):
    monkeypatch.setattr(
        lossless,
        "_proposer",
        lambda models, kind, k: _cross_proposer(models, k, ClaimsUniformDrafts),
    )
    result, _ = lossless.run_case(word_models, lossless.Case("t1.0", 3, "cross"))
    assert min(result.values()) < lossless.ALPHA, result


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
