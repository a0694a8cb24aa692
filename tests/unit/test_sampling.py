"""Tests of specdec.sampling: the processed distribution, seeded draws, logprobs, TorchSampler."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import chi_square_pvalue
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec import sampling
from specdec.config import SamplingParams
from specdec.interfaces import Sampler
from specdec.sampling import (
    SamplingTensors,
    TorchSampler,
    draw_uniforms,
    inverse_cdf,
    logprobs_of,
    make_generator,
    processed_probs,
    sample_from_probs,
)

F64 = torch.float64


def _tensors(params: list[SamplingParams]) -> SamplingTensors:
    return SamplingTensors.from_params(params, "cpu")


def _hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[vocab] transformers' warpers (temperature, top-k, top-p, min-p) then softmax."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(float(params.temperature))])
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    return torch.softmax(warpers(None, logits[None].clone()), dim=-1)[0]




def test_chi_square_pvalue_matches_known_quantiles():
    # chi2(1) 95% quantile 3.841; chi2(4) 99% quantile 13.277.
    df1 = torch.special.gammaincc(torch.tensor(0.5, dtype=F64), torch.tensor(3.841 / 2, dtype=F64))
    df4 = torch.special.gammaincc(torch.tensor(2.0, dtype=F64), torch.tensor(13.277 / 2, dtype=F64))
    assert float(df1) == pytest.approx(0.05, abs=1e-4)
    assert float(df4) == pytest.approx(0.01, abs=1e-4)


# --- processed_probs: parity with transformers -------------------------------------------------


def _random_params(gen: torch.Generator, vocab: int, count: int) -> list[SamplingParams]:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    return [
        SamplingParams(
            temperature=pick([0.3, 0.7, 1.0, 1.5, 2.5]),
            top_k=pick([0, 0, 1, 2, 5, 17, vocab, vocab + 10]),
            top_p=pick([1.0, 1.0, 0.3, 0.7, 0.9, 0.99]),
            min_p=pick([0.0, 0.0, 0.05, 0.3]),
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_processed_probs_matches_transformers_warpers(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 40
    params = _random_params(gen, vocab, 64)
    logits = torch.randn(64, vocab, generator=gen, dtype=F64) * 3
    probs = processed_probs(logits, _tensors(params))
    assert probs.dtype == F64
    for i, p in enumerate(params):
        expected = _hf_probs(logits[i], p)
        torch.testing.assert_close(probs[i], expected, rtol=1e-12, atol=1e-14)
        assert torch.equal(probs[i] > 0, expected > 0), p


@pytest.mark.parametrize("first_width", [1, 3])
def test_top_p_cut_beyond_the_first_candidates_is_exact(monkeypatch, first_width):
    # Few candidates force the widening retries (and finally the full sort).
    monkeypatch.setattr(sampling, "_TOP_P_FIRST_WIDTH", first_width)
    monkeypatch.setattr(sampling, "_TOP_P_WIDEN", 2)
    gen = torch.Generator().manual_seed(7)
    params = [
        SamplingParams(temperature=2.0, top_p=0.97),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, top_k=30, top_p=0.95),
    ]
    logits = torch.randn(4, 50, generator=gen, dtype=F64)
    probs = processed_probs(logits, _tensors(params))
    for i, p in enumerate(params):
        torch.testing.assert_close(probs[i], _hf_probs(logits[i], p), rtol=1e-12, atol=1e-14)


def test_top_k_and_min_p_ties_match_transformers():
    # Integer logits are full of ties; transformers keeps every token tied with the k-th
    # (top-k) or with the min-p floor, and so do we.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (30, 12), generator=gen).to(F64)
    for params in [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.5, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=1),
    ]:
        probs = processed_probs(logits, _tensors([params] * 30))
        for i in range(30):
            expected = _hf_probs(logits[i], params)
            torch.testing.assert_close(probs[i], expected, rtol=1e-12, atol=1e-14)


def test_top_p_keeps_every_token_tied_with_the_cut():
    # Three tied tokens of ~0.30 each: 0.5 is reached inside the tie. transformers keeps two
    # of them, chosen by sort order; we keep all three, so the result is order-independent.
    logits = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=F64)
    probs = processed_probs(logits, _tensors([SamplingParams(temperature=1.0, top_p=0.5)]))
    torch.testing.assert_close(probs, torch.tensor([[1 / 3, 0.0, 1 / 3, 1 / 3]], dtype=F64))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.1, 0.6]),
    ties=st.booleans(),
)
def test_processed_probs_properties(seed, temperature, top_k, top_p, min_p, ties):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 10, generator=gen, dtype=F64) * 2
    if ties:
        logits = logits.round()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = processed_probs(logits, _tensors([params] * 3))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=F64))
    argmax = logits.argmax(-1, keepdim=True)
    if temperature == 0.0:
        assert torch.equal(probs, torch.zeros_like(probs).scatter_(1, argmax, 1.0))
        return
    # The argmax always survives; the kept set is "every token at or above a threshold".
    assert bool((probs.gather(1, argmax) > 0).all())
    for i in range(3):
        kept = logits[i][probs[i] > 0]
        assert (logits[i] >= kept.min()).sum() == kept.numel()
    # Permuting the vocabulary permutes the result (no dependence on sort order among ties).
    perm = torch.randperm(10, generator=gen)
    permuted = processed_probs(logits[:, perm], _tensors([params] * 3))
    torch.testing.assert_close(permuted, probs[:, perm])


def test_greedy_rows_are_one_hot_at_the_first_argmax():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, -1.0, 2.0, 2.5]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)]
    probs = processed_probs(logits, _tensors(params))
    assert probs.dtype == torch.float32
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    expected = torch.softmax(torch.tensor([3.0, -math.inf, -math.inf, 2.5]), -1)
    torch.testing.assert_close(probs[1], expected)
    all_greedy = processed_probs(logits, _tensors([SamplingParams()] * 2))
    assert torch.equal(all_greedy, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_filters_that_are_off_keep_everything():
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, -100.0]], dtype=F64)
    plain = torch.softmax(logits, -1)
    for params in [
        SamplingParams(temperature=1.0, top_p=1.0),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_k=500),
        SamplingParams(temperature=1.0, min_p=0.0),
    ]:
        torch.testing.assert_close(processed_probs(logits, _tensors([params])), plain)


def test_tiny_top_p_keeps_only_the_top_token():
    logits = torch.tensor([[1.0, 2.0, 0.0, 1.9]])
    probs = processed_probs(logits, _tensors([SamplingParams(temperature=1.0, top_p=1e-6)]))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_half_precision_logits_are_processed_in_float32():
    logits = torch.randn(2, 16).to(torch.bfloat16)
    probs = processed_probs(logits, _tensors([SamplingParams(temperature=0.7, top_p=0.9)] * 2))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="rows"):
        processed_probs(torch.zeros(3, 4), _tensors([SamplingParams()] * 2))
    with pytest.raises(ValueError, match="vocab"):
        processed_probs(torch.zeros(4), _tensors([SamplingParams()] * 4))
    with pytest.raises(TypeError, match="params"):
        SamplingTensors.from_params([{"temperature": 1.0}], "cpu")


def test_sampling_tensors_flags_and_rows():
    params = [
        SamplingParams(temperature=0.0, top_k=5),  # greedy: filters ignored
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.5, top_k=7, min_p=0.1),
    ]
    st_ = _tensors(params)
    assert st_.is_greedy == (True, False, False) and not st_.all_greedy
    assert st_.any_top_k and st_.any_top_p and st_.any_min_p and st_.max_top_k == 7
    assert st_.top_k.tolist() == [0, 0, 7]
    repeated = st_.repeat_rows(2)
    assert repeated.num_rows == 6
    assert repeated.is_greedy == (True, True, False, False, False, False)
    assert repeated.top_k.tolist() == [0, 0, 0, 0, 7, 7]
    assert st_.select_rows([2, 0]).top_k.tolist() == [7, 0]
    only_greedy = _tensors([SamplingParams(top_k=3, top_p=0.5)])
    assert only_greedy.all_greedy and not (only_greedy.any_top_k or only_greedy.any_top_p)


# --- draws ---------------------------------------------------------------------------------


def test_sample_from_probs_frequencies():
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1], dtype=F64)
    rows = 30_000
    gen = make_generator(11, "cpu")
    draws = sample_from_probs(probs.expand(rows, -1), [gen] * rows)
    counts = torch.bincount(draws, minlength=6)
    assert counts[2] == 0
    assert chi_square_pvalue(counts, probs) > 1e-4


def test_unnormalised_weights_are_sampled_as_their_normalisation():
    weights = torch.tensor([[0.0, 2.0, 0.0, 6.0]])
    uniforms = torch.tensor([0.0, 0.2499, 0.2501, 0.999999], dtype=F64)
    tokens = inverse_cdf(weights.expand(4, -1), uniforms)
    assert tokens.tolist() == [1, 1, 3, 3]


def test_inverse_cdf_never_returns_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]] * 3, dtype=torch.float32)
    # 1.0 is outside [0, 1) but stands for a float32 round-up of u * total past the end.
    tokens = inverse_cdf(probs, torch.tensor([0.0, 1.0 - 1e-12, 1.0], dtype=F64))
    assert tokens.tolist() == [1, 2, 2]


def test_inverse_cdf_guards_flat_steps_of_the_cdf(monkeypatch):
    # A non-sequential cumsum can put a zero-weight token's CDF entry above its left
    # neighbour's; simulate that and check the guard moves to a positive token.
    probs = torch.tensor([[0.25, 0.0, 0.75]])
    bumped = torch.tensor([[0.25, 0.2501, 1.0]])
    monkeypatch.setattr(sampling.torch, "cumsum", lambda x, dim: bumped)
    tokens = inverse_cdf(probs, torch.tensor([0.25005], dtype=F64))
    assert tokens.tolist() == [0]


def test_seeded_draws_are_reproducible():
    probs = torch.softmax(torch.randn(8, 100), -1)

    def draw(seed):
        return sample_from_probs(probs, [make_generator(seed + i, "cpu") for i in range(8)])

    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))
    fresh = [make_generator(None, "cpu").initial_seed() for _ in range(3)]
    assert len(set(fresh)) == 3


def test_draw_uniforms_coalesces_one_generator_and_keeps_per_row_streams():
    shared = make_generator(1, "cpu")
    together = draw_uniforms([shared, shared], [2, 3], "cpu")
    assert together.shape == (5,) and together.dtype == F64
    assert torch.equal(together, torch.rand(5, dtype=F64, generator=make_generator(1, "cpu")))
    a, b = make_generator(2, "cpu"), make_generator(3, "cpu")
    apart = draw_uniforms([a, b], [1, 2], "cpu")
    assert apart[0] == torch.rand(1, dtype=F64, generator=make_generator(2, "cpu"))[0]
    assert torch.equal(apart[1:], torch.rand(2, dtype=F64, generator=make_generator(3, "cpu")))
    assert draw_uniforms([], [], "cpu").shape == (0,)


# --- TorchSampler --------------------------------------------------------------------------


def test_torch_sampler_is_a_sampler():
    assert isinstance(TorchSampler(), Sampler)


def test_torch_sampler_greedy_rows_ignore_generators():
    logits = torch.randn(4, 50)
    params = [SamplingParams()] * 4
    gens = [make_generator(i, "cpu") for i in range(4)]
    states = [g.get_state() for g in gens]
    tokens = TorchSampler().sample(logits, params, gens)
    assert torch.equal(tokens, logits.argmax(-1))
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states, strict=True))
    assert torch.equal(TorchSampler().sample(logits, params, [None] * 4), tokens)


def test_torch_sampler_mixed_batch():
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5, seed=0),
        SamplingParams(temperature=0.0),
    ]
    sampler = TorchSampler()
    first = sampler.sample(logits, params, [None, make_generator(9, "cpu"), None])
    assert first[0] == logits[0].argmax() and first[2] == logits[2].argmax()
    # Written out by hand: softmax over the top 5 logits, and an inverse-CDF draw with the
    # row's generator's first uniform (greedy rows draw nothing from it).
    top = torch.topk(logits[1], 5)
    expected = torch.zeros(50)
    expected[top.indices] = torch.softmax(top.values, dim=0)
    probs = sampler.probs(logits, params)
    torch.testing.assert_close(probs[1], expected)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 50).float())
    u = torch.rand(1, dtype=torch.float64, generator=make_generator(9, "cpu")).item()
    cdf = torch.cumsum(expected.double()[top.indices.sort().values], dim=0)
    assert first[1] == top.indices.sort().values[int((cdf <= u * cdf[-1]).sum())]


# --- logprobs_of ---------------------------------------------------------------------------


def test_logprobs_of_sampled_and_greedy_rows():
    logits = torch.randn(2, 20, dtype=F64)
    params = [SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=0.0)]
    st_ = _tensors(params)
    tokens = torch.tensor([int(logits[0].argmax()), 3])
    token_lp, top_ids, top_lp = logprobs_of(logits, st_, tokens, 6)
    probs = processed_probs(logits, st_)
    # Sampled row: log of the processed distribution, -inf outside top-k.
    torch.testing.assert_close(token_lp[0], probs[0, tokens[0]].log())
    torch.testing.assert_close(top_lp[0, :4], probs[0].log().topk(4).values)
    assert bool(torch.isneginf(top_lp[0, 4:]).all())
    # Greedy row: log_softmax of the raw logits, not the one-hot's 0 / -inf.
    raw = torch.log_softmax(logits[1], -1)
    torch.testing.assert_close(token_lp[1], raw[3])
    assert torch.equal(top_ids[1], raw.topk(6).indices)
    assert top_ids.shape == top_lp.shape == (2, 6)
    _, none_ids, none_lp = logprobs_of(logits, st_, tokens, 0)
    assert none_ids.shape == none_lp.shape == (2, 0)
