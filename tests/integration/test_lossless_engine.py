"""End-to-end losslessness: what the real Generator emits is distributed as the target says.

A tiny random float64 target and a noisy copy of it as the draft (same 12-token vocabulary)
run through ``Generator`` + a proposer + ``ChainVerifier`` with the whole engine in the loop
(scheduler, paged KV, draft catch-up and rollback, verification, truncation at
``max_new_tokens``). Every request emits ``k + 2`` tokens: position 1 is sampled by the prefill
step, positions 2 .. k + 2 by speculative verification steps, so the last position is a bonus
token whenever all k drafts were accepted. The exact target distribution of the emitted tokens
is enumerated from the transformers model of the same weights (one forward over every prefix),
under the processed distribution (temperature, top-k, top-p), and chi-square tests of every
position, of every pair of neighbouring positions and of positions 1-2-3 jointly must not
reject it. The same statistics must reject deliberately wrong rules (negative controls), so a
pass means something.

Cases cover both sampled rules (requests without a seed: rejection sampling from a generator
stream; with one: the coupled rule over position-keyed noise, specdec.noise), a draft model,
an MTP head (also with a draft vocabulary: zero draft probability outside it), a draft model
whose embedding table is shorter than the target's (rows past a shared 10-token tokenizer are
padding: the draft gives the ids it lacks probability 0, and reads the ones the target emits
as its last row), prompt lookup
(one-hot drafts), a policy that picks a random k per request and step, and a page budget so
tight that running requests are preempted and recomputed.

Everything is seeded (the unseeded requests' streams by a patched ``make_generator``), so the
p-values are fixed numbers; ALPHA bounds the chance that a change which merely reshuffles the
random streams makes the correct rule fail.
"""

from __future__ import annotations

import copy
import functools
import itertools
import sys
from unittest import mock

import attrs
import pytest
import torch
from conftest import make_hf_model
from helpers import ScriptedPolicy, chi_square_pvalue, coin_rule, word_tokenizer

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams, noise
from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.loading import model_from_state_dict
from specdec.models.mtp_head import MTPModule as MTPHeadModel
from specdec.models.mtp_head import MTPModuleConfig as MTPHeadConfig
from specdec.proposers import DraftModel, MTPHead, PromptLookup, SuffixDecoding, SuffixHybrid
from specdec.sampling import SamplingTensors, make_generator, processed_probs
from specdec.verify import chain
from specdec.verify.chain import ChainVerifier

F64 = torch.float64
VOCAB = 12
# draft-padded: a draft of 11 rows, one tokenizer of 10 tokens (ids 10 and 11: padding).
PADDED_TOKENIZER, PADDED_DRAFT_ROWS = 10, 11
PROMPT = [3, 7, 1, 10]
BATCH = 1024  # requests per generate() call
NUM_BATCHES = 4
GREEDY_EVERY = 16  # one request in 16 is greedy, riding along in the batch (not counted)
# The smallest bug guarded against (draft probabilities reported at T = 0.9 for drafts drawn
# at 0.8) needs more samples than the others: at 4 batches its smallest p-value is ~2e-3.
WARMER_BATCHES = 12
SAMPLING = {
    "t0.8-topk8-topp0.9": dict(temperature=0.8, top_k=8, top_p=0.9),
    "t1.0": dict(temperature=1.0),
}


@attrs.frozen
class Case:
    """One configuration of the engine whose output distribution is tested."""

    sampling: str
    k: int
    proposer: str = "draft"  # draft | draft-confident | draft-vocab | draft-padded | mtp | mtp-vocab | mtp-confident | lookup | suffix | hybrid
    mode: str = "stream"  # stream (no seed: rejection sampling) | seeded (coupled rule)
    policy: str = "fixed"  # fixed k | random (a random k per request and step)
    pages: str = "roomy"  # roomy | tight (running requests are preempted)

    @property
    def num_positions(self) -> int:
        return self.k + 2

    @property
    def name(self) -> str:
        return "-".join([self.sampling, f"k{self.k}", self.proposer, self.mode, self.policy, self.pages])


CASES = [
    *(
        Case(sampling, k, proposer, mode)
        for sampling, k in (("t0.8-topk8-topp0.9", 2), ("t1.0", 3))
        for proposer in ("draft", "mtp")
        for mode in ("stream", "seeded")
    ),
    Case("t1.0", 3, "draft", "stream", policy="random"),
    Case("t0.8-topk8-topp0.9", 3, "draft", "seeded", policy="random"),
    Case("t1.0", 3, "lookup", "stream"),
    Case("t0.8-topk8-topp0.9", 2, "lookup", "seeded"),
    # Suffix decoding: one-hot trees from the prompt and earlier requests' outputs (the second
    # batch drafts from the first's), so the tree rule meets several children per node.
    Case("t1.0", 3, "suffix", "stream"),
    Case("t0.8-topk8-topp0.9", 3, "suffix", "seeded"),
    # SuffixHybrid with a rule choosing at random: suffix trees and draft chains in one batch.
    Case("t1.0", 3, "hybrid", "stream"),
    Case("t0.8-topk8-topp0.9", 3, "hybrid", "seeded"),
    Case("t1.0", 3, "mtp-vocab", "stream"),
    Case("t0.8-topk8-topp0.9", 3, "draft-vocab", "seeded"),
    Case("t1.0", 3, "draft-padded", "stream"),
    Case("t1.0", 3, "draft-confident", "stream"),
    Case("t0.8-topk8-topp0.9", 3, "draft-confident", "seeded"),
    Case("t1.0", 3, "mtp-confident", "stream"),
    Case("t1.0", 3, "draft", "stream", pages="tight"),
    Case("t0.8-topk8-topp0.9", 2, "mtp", "seeded", pages="tight"),
]


def statistics(n: int) -> list[str]:
    return [
        *(f"position {j}" for j in range(1, n + 1)),
        *(f"joint {j}-{j + 1}" for j in range(1, n)),
        "joint 1-2-3",
    ]


# Family-wise 1e-3 over every test of a correct rule, by Bonferroni.
ALPHA = 1e-3 / sum(len(statistics(c.num_positions)) for c in CASES)


def _specdec_model(hf_model):
    cfg = ModelConfig.from_hf_config(hf_model.config)
    state = iter(hf_model.state_dict().items())
    return model_from_state_dict(cfg, state, dtype=F64, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def models():
    return build_models()


def build_models():
    """(transformers target, specdec target, specdec draft), float64."""
    hf_target = make_hf_model("llama", 0, vocab_size=VOCAB, max_position_embeddings=64)
    hf_draft = copy.deepcopy(hf_target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # Flatter logits, so every token has real mass (max prob ~0.2-0.55 here) ...
        hf_target.lm_head.weight.mul_(0.5)
        hf_draft.lm_head.weight.mul_(0.5)
        # ... and a draft that agrees often but not always (per-token overlap ~0.4-0.85).
        for p in hf_draft.parameters():
            p.add_(0.25 * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return hf_target, _specdec_model(hf_target), _specdec_model(hf_draft)


def build_head(target) -> MTPHeadModel:
    """A random float64 MTP head on the specdec target (it drafts from its own distribution,
    overlapping the target's by roughly half on this 12-token vocabulary)."""
    torch.manual_seed(2)
    head = MTPHeadModel(target, MTPHeadConfig.for_target(target.config))
    return head.to(F64).eval().requires_grad_(False)


def _proposer(models, kind: str, k: int):
    if kind == "draft":
        return DraftModel.from_model(models[2], num_speculative_tokens=k)
    if kind == "draft-confident":  # chains end after a draft token of draft probability < 0.15
        return DraftModel.from_model(models[2], num_speculative_tokens=k, confidence_threshold=0.15)
    if kind == "draft-vocab":  # the draft model drafts from 7 of the 12 tokens only
        return DraftModel.from_model(models[2], num_speculative_tokens=k, draft_vocab=[0, 1, 3, 4, 7, 9, 10])
    if kind == "draft-padded":
        short = cut_vocabulary(models[2], PADDED_DRAFT_ROWS)
        return DraftModel.from_model(short, num_speculative_tokens=k, tokenizer=word_tokenizer(PADDED_TOKENIZER))
    if kind == "lookup":
        return PromptLookup(num_speculative_tokens=k)
    if kind == "suffix":  # every match may draft up to k nodes (a 1-token match too)
        return SuffixDecoding(num_speculative_tokens=k, spec_offset=float(k), min_token_prob=0.05)
    if kind == "hybrid":
        suffix = SuffixDecoding(num_speculative_tokens=k, spec_offset=float(k), min_token_prob=0.05)
        return SuffixHybrid(DraftModel.from_model(models[2], num_speculative_tokens=k), suffix, rule=coin_rule(5))
    # "mtp-vocab": the head drafts from 7 of the 12 tokens only (zero draft mass elsewhere);
    # "mtp-confident": chains end after a draft of head probability < 0.15.
    vocab = torch.tensor([0, 1, 3, 4, 7, 9, 10]) if kind == "mtp-vocab" else None
    threshold = 0.15 if kind == "mtp-confident" else 0.0
    return MTPHead.from_model(
        build_head(models[1]), num_speculative_tokens=k, draft_vocab=vocab, confidence_threshold=threshold
    )


def cut_vocabulary(model: LlamaModel, rows: int) -> LlamaModel:
    """``model`` with its embedding and LM head cut to their first ``rows`` rows."""
    state = {
        name: t[:rows] if name in ("embed_tokens.weight", "lm_head.weight") else t
        for name, t in model.state_dict().items()
    }
    cut = LlamaModel(attrs.evolve(model.config, vocab_size=rows)).to(F64)
    cut.load_state_dict(state)
    return cut.eval().requires_grad_(False)


def _params(case: Case, seed: int | None) -> SamplingParams:
    """Greedy for ``seed=None``; sampled otherwise, with ``seed`` in the seeded mode only (the
    stream mode's requests draw from the patched generators of :func:`_streams`).

    ``k + 2`` tokens: the prefill's, then k drafts and the bonus of the first verify step (the
    engine never drafts past a request's remaining budget, so it may draft all k).
    """
    kwargs = SAMPLING[case.sampling] if seed is not None else dict(temperature=0.0)
    seed = seed if case.mode == "seeded" else None
    return SamplingParams(max_new_tokens=case.num_positions, seed=seed, ignore_eos=True, **kwargs)


def _streams(first: int):
    """Unseeded requests get generators with fixed (not random) well-mixed seeds, numbered
    from ``first``, so the test is repeatable. (Seeds 0, 1, 2, ... might not do: mt19937
    generators with neighbouring seeds start alike.)"""
    seeds = (noise.row_key(77, i) for i in itertools.count(first))
    return mock.patch(
        "specdec.generator.make_generator", lambda seed, device: make_generator(next(seeds), device)
    )


@functools.cache
def _exact_joint(sampling: str, n: int) -> torch.Tensor:
    return exact_joint(build_models()[0], SamplingParams(**SAMPLING[sampling]), n)


def exact_joint(hf_target, params: SamplingParams, n: int) -> torch.Tensor:
    """[vocab] * n float64: the target's probability of emitting (x_1, ..., x_n)."""
    prefixes = torch.cartesian_prod(*[torch.arange(VOCAB)] * (n - 1)).view(-1, n - 1)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = hf_target(ids).logits[:, -n:]  # [vocab^(n-1), n, vocab]: rows predict x_1..x_n
    st = SamplingTensors.from_params([params] * logits[..., 0].numel(), "cpu")
    probs = processed_probs(logits.reshape(-1, VOCAB), st).reshape(*[VOCAB] * (n - 1), n, VOCAB)
    joint = probs[(0,) * (n - 1) + (0,)]  # [vocab]: x_1 follows the prompt alone
    for m in range(2, n + 1):
        # p(x_m | x_1..x_{m-1}): any later prefix tokens do not matter to row m - 1 (causal).
        cond = probs[(...,) + (0,) * (n - m) + (m - 1, slice(None))]  # [vocab]*(m-1) + [vocab]
        joint = joint[..., None] * cond
    return joint


def sample(
    models, case: Case, verifier=None, num_batches: int = NUM_BATCHES
) -> tuple[torch.Tensor, Generator]:
    """[runs, k + 2] int64 tokens emitted by the sampled requests of ``num_batches`` batches.

    Every batch also carries greedy requests, which must come out as plain greedy decoding.
    Each generate() call admits its whole batch in one prefill step (roomy pages), so every
    later step is decode-only and speculates.
    """
    target = models[1]
    page_size, pages = (16, 2 * BATCH) if case.pages == "roomy" else (2, 2600)
    gen = Generator.from_components(
        target,
        # The target's tokenizer, which a padded draft's must be (the others need none).
        word_tokenizer(PADDED_TOKENIZER) if case.proposer == "draft-padded" else None,
        proposer=_proposer(models, case.proposer, case.k),
        # Roomy: twice the pages a batch needs (admission keeps a page of headroom per running
        # request; with fewer, part of the batch would be admitted by a later mixed step).
        # Tight: 2-slot pages, about half of what the batch needs at its longest with k drafts
        # in flight: requests are admitted in waves, preempted and recomputed as they grow
        # (~200 preemptions per batch), and speculate when pages allow (~900 drafts a batch).
        cache_config=CacheConfig(
            max_batch_size=BATCH,
            max_model_len=len(PROMPT) + case.num_positions,
            page_size=page_size,
            num_pages=pages,
        ),
        verifier=verifier,
        policy=FixedPolicy(case.k) if case.policy == "fixed" else ScriptedPolicy(7, case.k),
    )
    greedy = _params(case, None)
    plain_greedy = Generator.from_components(target).generate(PROMPT, greedy).token_ids
    sampled: list[list[int]] = []
    for b in range(num_batches):
        params = [
            _params(case, None if i % GREEDY_EVERY == GREEDY_EVERY - 1 else b * BATCH + i)
            for i in range(BATCH)
        ]
        with _streams(first=b * BATCH):
            outs = gen.generate([PROMPT] * BATCH, params)
        for out, p in zip(outs, params):
            assert len(out.token_ids) == case.num_positions
            if p.is_greedy:
                assert out.token_ids == plain_greedy
            else:
                sampled.append(out.token_ids)
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]
    assert len(sampled) == num_batches * (BATCH - BATCH // GREEDY_EVERY)
    if case.pages == "tight":
        assert gen.scheduler.num_preemptions > 0
    return torch.tensor(sampled), gen


def run_case(
    models, case: Case, verifier=None, num_batches: int = NUM_BATCHES
) -> tuple[dict[str, float], Generator]:
    """Chi-square p-value of each statistic against the exact target distribution."""
    n = case.num_positions
    joint = _exact_joint(case.sampling, n)
    tokens, gen = sample(models, case, verifier, num_batches)
    counts = torch.zeros(*[VOCAB] * n, dtype=F64)
    counts.index_put_(tuple(tokens.T), torch.ones(len(tokens), dtype=F64), accumulate=True)

    def marginal(t: torch.Tensor, keep: tuple[int, ...]) -> torch.Tensor:
        return t.sum(tuple(d for d in range(n) if d not in keep))

    result = {}
    for name in statistics(n):
        keep = tuple(int(x) - 1 for x in name.split()[1].split("-"))
        result[name] = chi_square_pvalue(marginal(counts, keep), marginal(joint, keep))
    return result, gen


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_generator_output_matches_the_target_distribution(models, case):
    result, gen = run_case(models, case)
    assert min(result.values()) > ALPHA, result
    m = gen.metrics
    # Both branches of the rule were exercised at every draft position, and full acceptances
    # (bonus tokens at position k + 2) happened.
    assert 0.02 < m.acceptance_rate < 0.95, m.acceptance_rate
    # (Prompt lookup's and suffix decoding's drafts on this random model are rarely right
    # past the first.)
    for j in range(1 if case.proposer in ("lookup", "suffix", "hybrid") else case.k):
        drafted, accepted = m.drafted_per_position[j], m.accepted_per_position[j]
        assert 5 < accepted < 0.98 * drafted, (j, drafted, accepted)
    if case.policy == "random":
        assert len(m.k_histogram) == case.k + 1  # every k from 0 to k was chosen
    if case.proposer.endswith("-confident"):  # chains of every length, the longer ones fewer
        first, second, third = m.drafted_per_position
        assert first > 1.5 * second and second > 1.5 * third, m.drafted_per_position


def _swapped_acceptance(target_at_draft, draft_at_draft):
    """Bug: min(1, draft / target) instead of min(1, target / draft)."""
    tiny = torch.finfo(target_at_draft.dtype).tiny
    return (draft_at_draft / target_at_draft.clamp_min(tiny)).clamp(max=1.0)


def _forgotten_residual(target_row, draft_row):
    """Bug: the recovered token drawn from the target row, not from the residual."""
    return target_row


class BuggyVerifier(ChainVerifier):
    """ChainVerifier with one of its pure functions swapped for a wrong one during verify."""

    def __init__(self, name: str, replacement) -> None:
        self.name = name
        self.replacement = replacement

    def verify(self, target_logits, proposal, params, generators, **kwargs):
        with mock.patch.object(chain, self.name, self.replacement):
            return super().verify(target_logits, proposal, params, generators, **kwargs)


BUGS = {
    "swapped-acceptance": ("acceptance_probability", _swapped_acceptance),
    "forgotten-residual": ("residual_distribution", _forgotten_residual),
}


@pytest.mark.parametrize(
    ("bug", "case"),
    [
        ("swapped-acceptance", Case("t1.0", 3)),
        ("forgotten-residual", Case("t0.8-topk8-topp0.9", 2)),
        ("forgotten-residual", Case("t1.0", 3, "lookup")),  # one-hot drafts: target minus x
    ],
    ids=["swapped-acceptance", "forgotten-residual", "forgotten-residual-lookup"],
)
def test_the_check_rejects_a_buggy_verifier(models, bug, case):
    result, _ = run_case(models, case, verifier=BuggyVerifier(*BUGS[bug]))
    assert result["position 1"] > ALPHA  # prefill sampling does not go through the verifier
    assert min(result.values()) < ALPHA, result


class OffByOneMTPHead(MTPHead):
    """Plausible proposer bug: each draft reported with the distribution of the *next*
    position (an off-by-one in the per-position probabilities) instead of its own."""

    def propose(self, ctx):
        out = super().propose(ctx)
        shifted = torch.roll(out.draft_probs, shifts=-1, dims=1)
        return attrs.evolve(out, draft_probs=shifted)


def test_the_check_rejects_an_mtp_head_that_misreports_its_distribution(models, monkeypatch):
    monkeypatch.setattr(
        sys.modules[__name__],
        "_proposer",
        lambda models, kind, k: OffByOneMTPHead.from_model(build_head(models[1]), num_speculative_tokens=k),
    )
    result, _ = run_case(models, Case("t1.0", 3, "mtp"))
    assert min(result.values()) < ALPHA, result


def test_the_check_rejects_a_draft_that_reports_a_slightly_warmer_distribution(models, monkeypatch):
    """The smallest plausible bug we guard against: drafts drawn at T = 0.8 but reported at
    T = 0.9. Sampled at the sizes above the effect is visible (checked: p < ALPHA)."""
    real = DraftModel.propose

    def warmer_report(self, ctx):
        out = real(self, ctx)
        if out.draft_probs is None:
            return out
        # The draft's probabilities at 0.9 are those at 0.8 re-tempered: p^(0.8/0.9), renormalised
        # over the same support (the request has no top-k/top-p here, so the support is all).
        reported = out.draft_probs.clamp_min(1e-300) ** (0.8 / 0.9)
        return attrs.evolve(out, draft_probs=reported / reported.sum(-1, keepdim=True))

    monkeypatch.setattr(DraftModel, "propose", warmer_report)
    monkeypatch.setitem(SAMPLING, "t0.8", dict(temperature=0.8))
    result, _ = run_case(models, Case("t0.8", 3, "draft"), num_batches=WARMER_BATCHES)
    assert min(result.values()) < ALPHA, result


def test_the_check_rejects_seeded_noise_that_ignores_the_position(models, monkeypatch):
    """Plausible bug in the seeded rule: the noise keyed by the seed alone, so every position
    of a request reuses one noise vector. Each position alone is still distributed right; the
    joint statistics must see the dependence."""
    real = noise.row_key
    monkeypatch.setattr(noise, "row_key", lambda seed, position: real(seed, 0))
    result, _ = run_case(models, Case("t1.0", 3, "draft", "seeded"))
    assert min(v for k, v in result.items() if k.startswith("joint")) < ALPHA, result


def _siblings_judged_independently(p, tokens):
    """Bug: each of a node's one-hot children tested against the target's p itself, and the
    recovered token drawn from p (a rejected sibling's token may come back)."""
    accept = torch.stack([p[t] for t in tokens]) if tokens else p.new_zeros(0)
    return accept, p.expand(len(tokens) + 1, -1)


def test_the_check_rejects_suffix_trees_with_siblings_judged_independently(models):
    """Suffix decoding drafts one-hot trees with several children per node; the tree rule
    must judge siblings one after another (a rejected sibling's token leaves the distribution)."""
    from specdec.verify import tree

    with mock.patch.object(tree, "sibling_step_deterministic", _siblings_judged_independently):
        result, gen = run_case(models, Case("t1.0", 3, "suffix"))
    assert gen.metrics.num_drafted > gen.metrics.num_verify_steps  # more than one node a step
    assert min(result.values()) < ALPHA, result


def test_the_check_rejects_hybrid_draft_distributions_one_position_off(models):
    """SuffixHybrid must put each chain's draft distributions at their own nodes (bug: each
    node gets the next node's distribution, an off-by-one when a chain becomes a tree)."""
    from specdec.proposers import hybrid

    with mock.patch.object(hybrid.SuffixHybrid, "_merge_model", _merge_one_off):
        result, gen = run_case(models, Case("t1.0", 3, "hybrid"))
    assert gen.proposer.num_model_steps > 0 and gen.proposer.num_suffix_steps > 0
    assert min(result.values()) < ALPHA, result


_ORIGINAL_MERGE = SuffixHybrid._merge_model


def _merge_one_off(self, *args):
    probs = _ORIGINAL_MERGE(self, *args)
    return None if probs is None else probs.roll(-1, dims=1)
