"""Tests of specdec.verify.chain: crafted cases, oracles, and the losslessness of the rule.

The losslessness test runs speculative generation over a toy Markov "model" (a target
transition matrix and a different draft matrix over a small vocabulary, float64) and checks,
with a chi-square test per emitted position, that every position's marginal equals the exact
target Markov marginal. Three deliberately wrong rules (negative controls) must fail it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import chi_square_pvalue

from specdec.config import SamplingParams
from specdec.interfaces import Verifier
from specdec.sampling import SamplingTensors, inverse_cdf, make_generator, processed_probs
from specdec.types import PAD_TOKEN_ID, DraftProposal, ProposalKind
from specdec.verify import chain
from specdec.verify.chain import ChainVerifier, greedy_verify, rejection_verify

F64 = torch.float64
PAD = PAD_TOKEN_ID


def _crafted_logits(argmax_rows: list[list[int]], vocab: int) -> torch.Tensor:
    """[batch, width + 1, vocab] float64: +100 at each row's chosen token, -100 elsewhere."""
    logits = torch.full((len(argmax_rows), len(argmax_rows[0]), vocab), -100.0, dtype=F64)
    for i, row in enumerate(argmax_rows):
        for j, token in enumerate(row):
            logits[i, j, token] = 100.0
    return logits


def _one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., vocab] float64 one-hot of ``ids`` (PAD rows all zero)."""
    out = torch.zeros(*ids.shape, vocab, dtype=F64)
    return out.scatter_(-1, ids.clamp_min(0)[..., None], 1.0) * (ids >= 0)[..., None]


# Sequence 0 mismatches at draft 2; sequence 1 is fully accepted (bonus 3); sequence 2 drafts
# nothing; sequence 3 drafts one token and its padding would match if it were read.
TARGET_ARGMAX = [[1, 2, 5, 4], [0, 1, 2, 3], [4, 0, 0, 0], [2, 3, 1, 1]]
DRAFTS = torch.tensor([[1, 2, 3], [0, 1, 2], [PAD, PAD, PAD], [2, 3, 1]])
NUM_DRAFTS = (3, 3, 0, 1)
EXPECTED_ACCEPTED = [2, 3, 0, 1]
EXPECTED_EMITTED = [[1, 2, 5, PAD], [0, 1, 2, 3], [4, PAD, PAD, PAD], [2, 3, PAD, PAD]]


def test_greedy_verify_crafted():
    logits = _crafted_logits(TARGET_ARGMAX, vocab=6)
    num_accepted, emitted = greedy_verify(logits, DRAFTS, NUM_DRAFTS)
    assert num_accepted.tolist() == EXPECTED_ACCEPTED
    assert emitted.tolist() == EXPECTED_EMITTED
    # num_draft_tokens may also come as a tensor.
    again, _ = greedy_verify(logits, DRAFTS, torch.tensor(NUM_DRAFTS))
    assert again.tolist() == EXPECTED_ACCEPTED


@pytest.mark.parametrize("one_hot_drafts", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_verify_crafted(one_hot_drafts, seed):
    # A ±100 target is one-hot to float64 precision, so the outcome is forced for any seed:
    # matching drafts have acceptance 1, others 0, and the residual is the target's token.
    target_probs = torch.softmax(_crafted_logits(TARGET_ARGMAX, vocab=6), dim=-1)
    draft_probs = None if one_hot_drafts else _one_hot(DRAFTS, 6)
    gens = [make_generator(seed + i, "cpu") for i in range(4)]
    num_accepted, emitted = rejection_verify(target_probs, draft_probs, DRAFTS, NUM_DRAFTS, gens)
    assert num_accepted.tolist() == EXPECTED_ACCEPTED
    assert emitted.tolist() == EXPECTED_EMITTED


def test_rejection_verify_never_accepts_or_recovers_a_forbidden_token():
    # The target forbids token 0 everywhere; the draft insists on it.
    target_probs = torch.tensor([[[0.0, 0.5, 0.5], [0.0, 0.2, 0.8]]] * 200, dtype=F64)
    draft_probs = torch.tensor([[[0.9, 0.05, 0.05]]] * 200, dtype=F64)
    drafts = torch.zeros(200, 1, dtype=torch.int64)
    gen = make_generator(0, "cpu")
    num_accepted, emitted = rejection_verify(
        target_probs, draft_probs, drafts, [1] * 200, [gen] * 200
    )
    assert num_accepted.eq(0).all()
    assert emitted[:, 0].ne(0).all() and emitted[:, 1].eq(PAD).all()


def test_rejection_verify_degenerate_residual_falls_back_to_target():
    # Target and draft equal, but a u of exactly 1 (impossible for a true uniform) "rejects":
    # the residual is all zero and the recovered token must come from the target itself.
    target = torch.tensor([0.0, 0.25, 0.75], dtype=F64)
    residual = chain.residual_distribution(target[None], target[None])
    assert torch.equal(residual, target[None])
    bonus = chain.residual_distribution(target[None], torch.zeros(1, 3, dtype=F64))
    assert torch.equal(bonus, target[None])
    normalised = chain.residual_distribution(target[None], torch.tensor([[0.0, 0.5, 0.25]]).to(F64))
    torch.testing.assert_close(normalised, torch.tensor([[0.0, 0.0, 1.0]], dtype=F64))


def test_acceptance_probability():
    target = torch.tensor([0.5, 0.2, 0.0, 0.3, 0.0], dtype=F64)
    draft = torch.tensor([0.25, 0.4, 0.0, 0.0, 0.5], dtype=F64)
    alpha = chain.acceptance_probability(target, draft)
    assert alpha.tolist() == [1.0, 0.5, 0.0, 1.0, 0.0]


def test_rejection_verify_is_reproducible_per_sequence():
    gen = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(4, 4, 10, generator=gen, dtype=F64), -1)
    draft_probs = torch.softmax(torch.randn(4, 3, 10, generator=gen, dtype=F64), -1)
    drafts = inverse_cdf(draft_probs.reshape(-1, 10), torch.rand(12, generator=gen, dtype=F64))
    drafts = drafts.reshape(4, 3)

    def run(seeds):
        gens = [make_generator(s, "cpu") for s in seeds]
        return rejection_verify(target_probs, draft_probs, drafts, (3, 2, 3, 0), gens)

    first, second = run([1, 2, 3, 4]), run([1, 2, 3, 4])
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert any(not torch.equal(run([s, s + 1, s + 2, s + 3])[1], first[1]) for s in range(5, 15))


def test_identical_draft_is_always_fully_accepted():
    gen = torch.Generator().manual_seed(5)
    batch, width, vocab = 500, 4, 12
    logits = torch.randn(batch, width + 1, vocab, generator=gen, dtype=F64) * 2
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * batch, "cpu")
    target_probs = processed_probs(logits.reshape(-1, vocab), st.repeat_rows(width + 1))
    target_probs = target_probs.reshape(batch, width + 1, vocab)
    draft_probs = target_probs[:, :width].clone()
    drafts = inverse_cdf(
        draft_probs.reshape(-1, vocab), torch.rand(batch * width, generator=gen, dtype=F64)
    ).reshape(batch, width)
    counts = torch.randint(0, width + 1, (batch,), generator=gen).tolist()
    drafts = torch.where(torch.arange(width) < torch.tensor(counts)[:, None], drafts, PAD)
    num_accepted, _ = rejection_verify(
        target_probs, draft_probs, drafts, counts, [make_generator(0, "cpu")] * batch
    )
    assert num_accepted.tolist() == counts
    # The same through ChainVerifier, which processes the target logits itself.
    proposal = DraftProposal(
        kind=ProposalKind.CHAIN,
        draft_token_ids=drafts,
        num_draft_tokens=tuple(counts),
        draft_probs=draft_probs,
    )
    result = ChainVerifier().verify(
        logits, proposal, [SamplingParams(temperature=1.0)] * batch, [None] * batch
    )
    assert list(result.num_accepted) == counts


def test_chain_verifier_mixed_batch():
    vocab, width = 6, 3
    logits = _crafted_logits(TARGET_ARGMAX, vocab)
    logits[1] = torch.randn(width + 1, vocab, dtype=F64)  # a sampled sequence with a real choice
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
    ]
    greedy_gen = make_generator(3, "cpu")
    state = greedy_gen.get_state()
    proposal = DraftProposal(
        kind=ProposalKind.CHAIN,
        draft_token_ids=DRAFTS,
        num_draft_tokens=NUM_DRAFTS,
        draft_probs=_one_hot(DRAFTS, vocab),
    )
    gens = [greedy_gen, make_generator(1, "cpu"), None, None]
    result = ChainVerifier().verify(logits, proposal, params, gens)
    assert isinstance(ChainVerifier(), Verifier)
    assert torch.equal(greedy_gen.get_state(), state)  # greedy rows draw nothing

    greedy_rows = torch.tensor([0, 2, 3])
    num_accepted, emitted = greedy_verify(
        logits[greedy_rows], DRAFTS[greedy_rows], [NUM_DRAFTS[i] for i in (0, 2, 3)]
    )
    assert [result.num_accepted[i] for i in (0, 2, 3)] == num_accepted.tolist()
    assert torch.equal(result.emitted_token_ids[greedy_rows], emitted)

    acc = result.num_accepted[1]
    assert 0 <= acc <= 3 and result.num_emitted[1] == acc + 1
    row = result.emitted_token_ids[1]
    assert row[:acc].tolist() == DRAFTS[1, :acc].tolist()
    assert row[acc] >= 0 and row[acc + 1 :].eq(PAD).all()
    expected_rows = [[r if r <= a else PAD for r in range(width + 1)] for a in result.num_accepted]
    assert result.accepted_rows.tolist() == expected_rows


def test_chain_verifier_rejects_bad_input():
    logits = torch.zeros(1, 3, 5)
    tree = DraftProposal(
        kind=ProposalKind.TREE,
        draft_token_ids=torch.zeros(1, 2, dtype=torch.int64),
        num_draft_tokens=(2,),
        parents=torch.tensor([[-1, 0]]),
    )
    with pytest.raises(ValueError, match="CHAIN"):
        ChainVerifier().verify(logits, tree, [SamplingParams()], [None])
    chain_proposal = DraftProposal(
        kind=ProposalKind.CHAIN,
        draft_token_ids=torch.zeros(1, 2, dtype=torch.int64),
        num_draft_tokens=(3,),
    )
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ChainVerifier().verify(logits, chain_proposal, [SamplingParams()], [None])
    with pytest.raises(ValueError, match="draft_token_ids"):
        greedy_verify(torch.zeros(1, 4, 5), torch.zeros(1, 2, dtype=torch.int64), (1,))
    with pytest.raises(ValueError, match="generators"):
        rejection_verify(torch.zeros(1, 3, 5), None, torch.zeros(1, 2, dtype=torch.int64), (1,), [])


# --- losslessness --------------------------------------------------------------------------

VOCAB = 8
WIDTH = 3  # drafts per step; each step drafts a random 0..WIDTH of them
NUM_TOKENS = 4  # emitted positions checked
NUM_RUNS = 40_000  # independent generations, vectorised as the batch
CASES = {
    "t0.8-topk-topp": (SamplingParams(temperature=0.8, top_k=5, top_p=0.9), False),
    "t1.0-plain": (SamplingParams(temperature=1.0), False),
    "t0.7-topp-minp-onehot": (SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05), True),
}
# Family-wise 1e-3 over every (case, position) test of the correct rule (the cases plus one
# run through ChainVerifier), by Bonferroni.
ALPHA = 1e-3 / ((len(CASES) + 1) * NUM_TOKENS)




def _markov(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target logits and the processed target and draft transition matrices, each
    [vocab, vocab] float64 (row = previous token)."""
    gen = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(VOCAB, VOCAB, generator=gen, dtype=F64) * 1.5
    draft_logits = torch.randn(VOCAB, VOCAB, generator=gen, dtype=F64) * 1.5
    st = SamplingTensors.from_params([params] * VOCAB, "cpu")
    return target_logits, processed_probs(target_logits, st), processed_probs(draft_logits, st)


def _speculate(
    case: str,
    *,
    seed: int,
    bonus_from_draft: bool = False,
    via_verifier: bool = False,
) -> torch.Tensor:  # [NUM_RUNS, NUM_TOKENS] int64
    """NUM_RUNS speculative generations from token 0, until NUM_TOKENS tokens each.

    ``via_verifier`` hands raw target logits to ChainVerifier (which processes them itself)
    instead of processed rows to rejection_verify.
    """
    params, one_hot_drafts = CASES[case]
    target_logits, target_rows, draft_rows = _markov(params)
    gen = torch.Generator().manual_seed(seed)
    runs = torch.arange(NUM_RUNS)
    last = torch.zeros(NUM_RUNS, dtype=torch.int64)
    out = torch.full((NUM_RUNS, NUM_TOKENS * (WIDTH + 1)), PAD, dtype=torch.int64)
    filled = torch.zeros(NUM_RUNS, dtype=torch.int64)
    for _ in range(NUM_TOKENS):  # each step emits >= 1 token
        counts = torch.randint(0, WIDTH + 1, (NUM_RUNS,), generator=gen)  # [runs]
        prefix, draft_probs = [last], []
        for _ in range(WIDTH):
            rows = draft_rows[prefix[-1]]  # [runs, vocab]
            if one_hot_drafts:
                token = rows.argmax(-1)
            else:
                token = inverse_cdf(rows, torch.rand(NUM_RUNS, generator=gen, dtype=F64))
            prefix.append(token)
            draft_probs.append(rows)
        prefix_ids = torch.stack(prefix, dim=1)  # [runs, WIDTH + 1]
        drafts = torch.where(torch.arange(WIDTH) < counts[:, None], prefix_ids[:, 1:], PAD)
        stacked_draft_probs = None if one_hot_drafts else torch.stack(draft_probs, dim=1)
        if via_verifier:
            proposal = DraftProposal(
                kind=ProposalKind.CHAIN,
                draft_token_ids=drafts,
                num_draft_tokens=tuple(counts.tolist()),
                draft_probs=stacked_draft_probs,
            )
            result = ChainVerifier().verify(
                target_logits[prefix_ids], proposal, [params] * NUM_RUNS, [gen] * NUM_RUNS
            )
            num_accepted = torch.tensor(result.num_accepted)
            emitted = result.emitted_token_ids
        else:
            target_probs = target_rows[prefix_ids]  # [runs, WIDTH + 1, vocab]
            if bonus_from_draft:  # negative control: row n only ever serves the bonus token
                target_probs[runs, counts] = draft_rows[prefix_ids[runs, counts]]
            num_accepted, emitted = rejection_verify(
                target_probs, stacked_draft_probs, drafts, counts.tolist(), [gen] * NUM_RUNS
            )
        columns = filled[:, None] + torch.arange(WIDTH + 1)  # [runs, WIDTH + 1]
        keep = emitted != PAD
        out[runs[:, None].expand_as(columns)[keep], columns[keep]] = emitted[keep]
        filled += num_accepted + 1
        last = emitted[runs, num_accepted]
    return out[:, :NUM_TOKENS]


def _position_pvalues(case: str, seed: int, **kwargs) -> list[float]:
    """Chi-square p-value of each emitted position against the exact target marginal."""
    _, target_rows, _ = _markov(CASES[case][0])
    tokens = _speculate(case, seed=seed, **kwargs)
    marginal = torch.zeros(VOCAB, dtype=F64)
    marginal[0] = 1.0
    pvalues = []
    for position in range(NUM_TOKENS):
        marginal = marginal @ target_rows  # exact target marginal of this position
        counts = torch.bincount(tokens[:, position], minlength=VOCAB)
        pvalues.append(chi_square_pvalue(counts, marginal))
    return pvalues


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_verify_is_lossless(case):
    pvalues = _position_pvalues(case, seed=2024)
    assert min(pvalues) > ALPHA, pvalues


def test_chain_verifier_is_lossless():
    pvalues = _position_pvalues("t0.8-topk-topp", seed=7, via_verifier=True)
    assert min(pvalues) > ALPHA, pvalues


def _swapped_acceptance(target_at_draft, draft_at_draft):
    """Bug (a): min(1, draft / target) instead of min(1, target / draft)."""
    tiny = torch.finfo(target_at_draft.dtype).tiny
    return (draft_at_draft / target_at_draft.clamp_min(tiny)).clamp(max=1.0)


def _forgotten_residual(target_row, draft_row):
    """Bug (b): the recovered token drawn from the target row, not the residual."""
    return target_row


NEGATIVE_CONTROLS = [
    ("swapped-acceptance", "t0.8-topk-topp"),
    ("swapped-acceptance", "t0.7-topp-minp-onehot"),
    ("forgotten-residual", "t0.8-topk-topp"),
    ("forgotten-residual", "t0.7-topp-minp-onehot"),
    ("bonus-from-draft", "t0.8-topk-topp"),
    ("bonus-from-draft", "t1.0-plain"),
]


@pytest.mark.parametrize(("bug", "case"), NEGATIVE_CONTROLS)
def test_losslessness_check_rejects_wrong_rules(monkeypatch, bug, case):
    # Our inverse-CDF sampler renormalises any weights, so an unnormalised residual is not a
    # bug here; drawing the bonus token from the draft stands in as the third wrong rule.
    kwargs = {}
    if bug == "swapped-acceptance":
        monkeypatch.setattr(chain, "acceptance_probability", _swapped_acceptance)
    elif bug == "forgotten-residual":
        monkeypatch.setattr(chain, "residual_distribution", _forgotten_residual)
    else:
        kwargs["bonus_from_draft"] = True
    pvalues = _position_pvalues(case, seed=2024, **kwargs)
    assert min(pvalues) < ALPHA, pvalues
