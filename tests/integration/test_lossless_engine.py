"""End-to-end losslessness: what the real Generator emits is distributed as the target says.

A tiny random float64 target and a noisy copy of it as the draft (same 12-token vocabulary)
run through ``Generator`` + ``DraftModel`` + ``ChainVerifier`` with the whole engine in the
loop (scheduler, paged KV, draft catch-up and rollback, verification, truncation at
``max_new_tokens``). Position 1 is sampled by the prefill step, positions 2 and 3 by
speculative verification steps. The exact target distribution of the three emitted tokens is
enumerated from the transformers model of the same weights (a 144-sequence forward), under the
processed distribution (temperature, top-k, top-p), and chi-square tests per position, on the
joint of positions 2-3 and on the joint of all three must not reject it. The same statistics
must reject a verifier with a deliberately wrong rule (negative controls), so a pass means
something.

Two kinds of sampled request take different verification rules, so both run: requests without
a seed (``stream``: rejection sampling from each request's generator stream) and requests
with one (``seeded``: the coupled rule over position-keyed noise, specdec.noise).

Everything is seeded (the unseeded requests' streams by a patched ``make_generator``), so the
p-values are fixed numbers; ALPHA bounds the chance that a change which merely reshuffles the
random streams makes the correct rule fail.
"""

from __future__ import annotations

import copy
import itertools
import sys
from unittest import mock

import attrs
import pytest
import torch
from conftest import make_hf_model
from helpers import chi_square_pvalue

from specdec import CacheConfig, Generator, SamplingParams, noise
from specdec.models.heads import MTPHeadConfig, MTPHeadModel
from specdec.models.llama import ModelConfig
from specdec.models.loading import model_from_state_dict
from specdec.proposers import DraftModel, MTPHead
from specdec.sampling import SamplingTensors, make_generator, processed_probs
from specdec.verify import chain
from specdec.verify.chain import ChainVerifier

F64 = torch.float64
VOCAB = 12
PROMPT = [3, 7, 1, 10]
BATCH = 1024  # requests per generate() call, all admitted at once: every decode step speculates
NUM_BATCHES = 4
GREEDY_EVERY = 16  # one request in 16 is greedy, riding along in the batch (not counted)
NUM_RUNS = NUM_BATCHES * (BATCH - BATCH // GREEDY_EVERY)  # sampled requests per case
CASES = {
    "t0.8-topk8-topp0.9-k2": (dict(temperature=0.8, top_k=8, top_p=0.9), 2),
    "t1.0-k3": (dict(temperature=1.0), 3),
}
STATISTICS = ("position 1", "position 2", "position 3", "joint 2-3", "joint 1-2-3")
PROPOSERS = ("draft", "mtp")
MODES = ("stream", "seeded")
# Family-wise 1e-3 over every test of the correct rule, by Bonferroni.
ALPHA = 1e-3 / (len(CASES) * len(PROPOSERS) * len(MODES) * len(STATISTICS))




def _specdec_model(hf_model):
    cfg = ModelConfig.from_hf_config(hf_model.config)
    state = iter(hf_model.state_dict().items())
    return model_from_state_dict(cfg, state, dtype=F64, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def models():
    return build_models()


def build_head(target) -> MTPHeadModel:
    """A random float64 MTP head on the specdec target (it drafts from its own distribution,
    overlapping the target's by roughly half on this 12-token vocabulary)."""
    torch.manual_seed(2)
    head = MTPHeadModel(target, MTPHeadConfig.for_target(target.config))
    return head.to(F64).eval().requires_grad_(False)


def _proposer(models, kind: str, k: int):
    if kind == "draft":
        return DraftModel.from_model(models[2], num_speculative_tokens=k)
    return MTPHead.from_model(build_head(models[1]), num_speculative_tokens=k)


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


def _params(case: str, seed: int | None, mode: str = "seeded") -> SamplingParams:
    """Greedy for ``seed=None``; sampled otherwise, with ``seed`` in the seeded mode only (the
    stream mode's requests draw from the patched generators of :func:`_streams`)."""
    kwargs = CASES[case][0] if seed is not None else dict(temperature=0.0)
    # Five tokens so that after the prefill token every request may still draft k <= 3 tokens
    # (the engine never drafts past a request's remaining budget); positions 1-3 are tested.
    seed = seed if mode == "seeded" else None
    return SamplingParams(max_new_tokens=5, seed=seed, ignore_eos=True, **kwargs)


def _streams(first: int):
    """Unseeded requests get generators with fixed (not random) well-mixed seeds, numbered
    from ``first``, so the test is repeatable. (Seeds 0, 1, 2, ... might not do: mt19937
    generators with neighbouring seeds start alike.)"""
    seeds = (noise.row_key(77, i) for i in itertools.count(first))
    return mock.patch(
        "specdec.generator.make_generator", lambda seed, device: make_generator(next(seeds), device)
    )


def exact_joint(hf_target, params: SamplingParams) -> torch.Tensor:
    """[vocab, vocab, vocab] float64: the target's probability of emitting (x1, x2, x3)."""
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [vocab^2, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = hf_target(ids).logits[:, -3:]  # [vocab^2, 3, vocab]: rows predict x1, x2, x3
    st = SamplingTensors.from_params([params] * (3 * len(pairs)), "cpu")
    probs = processed_probs(logits.reshape(-1, VOCAB), st).reshape(VOCAB, VOCAB, 3, VOCAB)
    p1 = probs[0, 0, 0]  # [vocab]
    p2 = probs[:, 0, 1]  # [x1, vocab]
    p3 = probs[:, :, 2]  # [x1, x2, vocab]
    return p1[:, None, None] * p2[:, :, None] * p3


def sample(
    models, case: str, verifier=None, proposer: str = "draft", mode: str = "stream"
) -> tuple[torch.Tensor, Generator]:
    """[NUM_RUNS, 3] int64 tokens emitted by NUM_RUNS seeded sampled requests through the engine.

    Every batch also carries greedy requests, which must come out as plain greedy decoding.
    Each generate() call admits its whole batch in one prefill step, and no request waits, so
    every later step is decode-only and speculates.
    """
    target = models[1]
    k = CASES[case][1]
    gen = Generator.from_components(
        target,
        proposer=_proposer(models, proposer, k),
        # Twice the pages a batch needs: admission keeps a page of headroom per running
        # request, and with fewer pages part of the batch would be admitted by a later
        # (mixed, non-speculative) step.
        cache_config=CacheConfig(
            max_batch_size=BATCH, max_num_tokens=len(PROMPT) + 5, page_size=16, num_pages=2 * BATCH
        ),
        verifier=verifier,
        policy=k,  # a fixed k: every decode step verifies drafts at positions 2-3
    )
    plain_greedy = Generator.from_components(target).generate(PROMPT, _params(case, None)).token_ids
    sampled: list[list[int]] = []
    for b in range(NUM_BATCHES):
        params = [
            _params(case, None if i % GREEDY_EVERY == GREEDY_EVERY - 1 else b * BATCH + i, mode)
            for i in range(BATCH)
        ]
        with _streams(first=b * BATCH):
            outs = gen.generate([PROMPT] * BATCH, params)
        for out, p in zip(outs, params):
            if p.is_greedy:
                assert out.token_ids[:3] == plain_greedy[:3]
            else:
                sampled.append(out.token_ids[:3])
                # One prefill step, then verification steps only: positions 2-3 were verified.
                assert out.metrics.num_verify_steps >= 1
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]
    assert len(sampled) == NUM_RUNS
    return torch.tensor(sampled), gen


def run_case(
    models, case: str, verifier=None, proposer: str = "draft", mode: str = "stream"
) -> tuple[dict[str, float], Generator]:
    """Chi-square p-value of each statistic against the exact target distribution."""
    joint = exact_joint(models[0], SamplingParams(**CASES[case][0]))
    tokens, gen = sample(models, case, verifier, proposer, mode)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=F64)
    counts.index_put_(tuple(tokens.T), torch.ones(len(tokens), dtype=F64), accumulate=True)
    result = {
        "position 1": chi_square_pvalue(counts.sum((1, 2)), joint.sum((1, 2))),
        "position 2": chi_square_pvalue(counts.sum((0, 2)), joint.sum((0, 2))),
        "position 3": chi_square_pvalue(counts.sum((0, 1)), joint.sum((0, 1))),
        "joint 2-3": chi_square_pvalue(counts.sum(0), joint.sum(0)),
        "joint 1-2-3": chi_square_pvalue(counts, joint),  # sparse cells pool into one bin
    }
    assert tuple(result) == STATISTICS
    return result, gen


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("case", list(CASES))
def test_generator_output_matches_the_target_distribution(models, case, proposer, mode):
    result, gen = run_case(models, case, proposer=proposer, mode=mode)
    assert min(result.values()) > ALPHA, result
    # Both branches of the rule were exercised, at the draft positions that feed positions 2-3.
    m = gen.metrics
    assert 0.2 < m.acceptance_rate < 0.9, m.acceptance_rate
    for j in range(2):
        assert (
            0.1 * m.drafted_per_position[j]
            < m.accepted_per_position[j]
            < 0.9 * m.drafted_per_position[j]
        )


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

    def verify(self, target_logits, proposal, params, generators):
        with mock.patch.object(chain, self.name, self.replacement):
            return super().verify(target_logits, proposal, params, generators)


BUGS = {
    "swapped-acceptance": ("acceptance_probability", _swapped_acceptance),
    "forgotten-residual": ("residual_distribution", _forgotten_residual),
}


@pytest.mark.parametrize(
    ("bug", "case"),
    [("swapped-acceptance", "t1.0-k3"), ("forgotten-residual", "t0.8-topk8-topp0.9-k2")],
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
    result, _ = run_case(models, "t1.0-k3", proposer="mtp")
    assert min(result.values()) < ALPHA, result


def test_the_check_rejects_seeded_noise_that_ignores_the_position(models, monkeypatch):
    """Plausible bug in the seeded rule: the noise keyed by the seed alone, so every position
    of a request reuses one noise vector. Each position alone is still distributed right; the
    joint statistics must see the dependence."""
    real = noise.row_key
    monkeypatch.setattr(noise, "row_key", lambda seed, position: real(seed, 0))
    result, _ = run_case(models, "t1.0-k3", proposer="draft", mode="seeded")
    assert min(result["joint 2-3"], result["joint 1-2-3"]) < ALPHA, result
