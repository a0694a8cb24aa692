"""A draft whose embedding table differs from the target's only by padding rows is accepted.

Qwen2.5 0.5B (151,936 rows) drafting for 7B (152,064 rows), one tokenizer of 151,665 tokens,
in miniature: a tiny random float64 Llama target of 528 rows and noisy copies of it cut to 520
rows or grown to 536, all saved by transformers with the same 512-token tokenizer (stories260K's)
beside them. Speculative greedy output must equal plain greedy output token for token, also when
the target's ids include ones the shorter draft has no row for (prompts given as ids reach
them). Sampled output keeps the target's distribution: a chi-square case with a shorter draft
is in test_lossless_engine.py. A draft of another tokenizer, a pair without tokenizers to
compare, and a tokenizer longer than a table are still refused, naming why.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_hf_model
from helpers import word_tokenizer

from specdec import Generator, SamplingParams
from specdec.models.loading import load_model
from specdec.models.padded_vocab import check_padded_vocab, fit_logits
from specdec.proposers import DraftModel

TARGET_ROWS, SHORT_ROWS, LONG_ROWS = 528, 520, 536
K = 4


def _noisy(hf, rows: int, seed: int):
    """A copy of ``hf`` with ``rows`` embedding rows (cut, or grown with fresh rows), every
    weight perturbed: a draft that agrees with the target often, not always."""
    draft = copy.deepcopy(hf)
    draft.resize_token_embeddings(rows, mean_resizing=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.2 * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return draft


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, stories_path):
    """name -> a directory with config.json, model.safetensors and a tokenizer."""
    from transformers import AutoTokenizer

    stories = AutoTokenizer.from_pretrained(stories_path)
    hf = make_hf_model("llama", seed=7, vocab_size=TARGET_ROWS)
    models = {
        "target": (hf, stories),
        "short": (_noisy(hf, SHORT_ROWS, 1), stories),
        "long": (_noisy(hf, LONG_ROWS, 2), stories),
        # As many tokens as stories260K's, other ones: not the target's tokenizer.
        "other-tokenizer": (_noisy(hf, SHORT_ROWS, 1), word_tokenizer(len(stories))),
    }
    paths = {}
    for name, (model, tokenizer) in models.items():
        paths[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def _prompts() -> list[list[int]]:
    """Random ids of the whole target vocabulary, padding ids past both drafts' tables too."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TARGET_ROWS, (n,), generator=g).tolist() for n in (5, 11, 17)]
    return [*prompts, [7, 525, 527, 513, 44], [SHORT_ROWS, TARGET_ROWS - 1]]


@pytest.mark.parametrize("draft", ["short", "long"])
def test_greedy_output_equals_plain_decoding(checkpoints, draft):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = Generator.from_pretrained(checkpoints["target"], dtype="float64").generate(
        _prompts(), params
    )
    proposer = DraftModel.from_pretrained(
        checkpoints[draft], dtype="float64", num_speculative_tokens=K
    )
    gen = Generator.from_pretrained(
        checkpoints["target"], dtype="float64", proposer=proposer, policy=K
    )
    spec = gen.generate(_prompts(), params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert 0 < gen.metrics.num_accepted < gen.metrics.num_drafted
    assert proposer.vocab_size == TARGET_ROWS  # its distributions span the target's ids


def test_suffix_hybrid_passes_the_target_tokenizer_to_its_draft(checkpoints):
    """SuffixHybrid forwards the capability, so its padded draft model is accepted too."""
    from specdec.interfaces import UsesTargetTokenizer
    from specdec.proposers import SuffixHybrid

    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = Generator.from_pretrained(checkpoints["target"], dtype="float64").generate(_prompts(), params)
    draft = DraftModel.from_pretrained(checkpoints["short"], dtype="float64", num_speculative_tokens=K)
    hybrid = SuffixHybrid(draft)
    assert isinstance(hybrid, UsesTargetTokenizer)
    gen = Generator.from_pretrained(checkpoints["target"], dtype="float64", proposer=hybrid)
    assert [o.token_ids for o in gen.generate(_prompts(), params)] == [o.token_ids for o in plain]


def test_sampled_drafts_span_the_target_vocabulary(checkpoints):
    """At temperature > 0 the draft's distributions go to the verifier over the target's ids:
    the shorter draft gives its missing ids probability 0."""
    proposer = DraftModel.from_pretrained(
        checkpoints["short"], dtype="float64", num_speculative_tokens=K
    )
    gen = Generator.from_pretrained(
        checkpoints["target"], dtype="float64", proposer=proposer, policy=K
    )
    seen = []
    real = proposer.propose

    def recording(ctx):
        out = real(ctx)
        seen.append(out.draft_probs)
        return out

    proposer.propose = recording
    gen.generate(
        _prompts(), SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    )
    probs = torch.cat([p.flatten(0, 1) for p in seen if p is not None])  # [rows, vocab]
    assert probs.shape[1] == TARGET_ROWS
    assert probs[:, SHORT_ROWS:].sum() == 0
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(probs), dtype=probs.dtype))


def test_a_draft_of_another_tokenizer_is_refused(checkpoints):
    proposer = DraftModel.from_pretrained(checkpoints["other-tokenizer"], dtype="float64")
    with pytest.raises(ValueError, match="the draft's tokenizer .* is not the target's"):
        Generator.from_pretrained(checkpoints["target"], dtype="float64", proposer=proposer)


def test_padding_cannot_be_told_without_both_tokenizers(checkpoints):
    target, _, _ = load_model(checkpoints["target"], dtype="float64")
    draft, _, _ = load_model(checkpoints["short"], dtype="float64")
    with_tokenizer = DraftModel.from_pretrained(checkpoints["short"], dtype="float64")
    with pytest.raises(ValueError, match="the target has none"):  # a generator of token ids only
        Generator.from_components(target, proposer=with_tokenizer)
    with pytest.raises(ValueError, match="the draft has none"):
        Generator.from_components(
            target, with_tokenizer.tokenizer, proposer=DraftModel.from_model(draft)
        )
    # Equal tables need no tokenizers, as before.
    Generator.from_components(target, proposer=DraftModel.from_model(target))


def test_rows_within_the_tokenizer_are_not_padding(checkpoints):
    target, _, _ = load_model(checkpoints["target"], dtype="float64")
    draft, _, _ = load_model(checkpoints["short"], dtype="float64")
    tokenizer = word_tokenizer(SHORT_ROWS + 4)  # token ids 520..523 are real: the draft lacks them
    proposer = DraftModel.from_model(draft, tokenizer=tokenizer)
    with pytest.raises(
        ValueError, match=f"tokenizer has {SHORT_ROWS + 4} tokens, more than the {SHORT_ROWS} rows"
    ):
        Generator.from_components(target, tokenizer, proposer=proposer)


def test_a_draft_vocabulary_past_the_target_is_refused(checkpoints):
    target, tokenizer_dir = checkpoints["target"], checkpoints["long"]
    proposer = DraftModel.from_pretrained(
        tokenizer_dir, dtype="float64", draft_vocab=[1, 2, TARGET_ROWS + 3]
    )
    with pytest.raises(
        ValueError, match=r"draft_vocab must hold token ids of the target's vocabulary \[0, 528\)"
    ):
        Generator.from_pretrained(target, dtype="float64", proposer=proposer)


def test_fit_logits_and_the_check_alone():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(fit_logits(logits, 3), logits)
    assert fit_logits(logits, 2).tolist() == [[1.0, 2.0]]
    assert fit_logits(logits, 5).tolist() == [[1.0, 2.0, 3.0, float("-inf"), float("-inf")]]
    tok = word_tokenizer(6)
    check_padded_vocab(8, 8, None, None)  # equal tables: nothing to check
    check_padded_vocab(7, 9, tok, word_tokenizer(6))  # equal contents, distinct objects
    with pytest.raises(ValueError, match="is not the target's"):
        check_padded_vocab(7, 9, tok, word_tokenizer(6, prefix="u"))
