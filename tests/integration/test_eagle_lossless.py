"""End-to-end losslessness of tree speculation: Generator + EAGLETree + TreeVerifier + engine.

The machinery of test_lossless_engine (a tiny random float64 Llama with a 12-token vocabulary,
the exact joint distribution of the emitted tokens enumerated from the transformers model of the
same weights, chi-square tests of every position, neighbouring pairs and positions 1-2-3) with a
random EAGLE-1 head drafting dynamic trees (top_k 3, depth 3, all 21 candidate nodes kept). Each request emits 4
tokens: position 1 from the prefill step, 2-4 from one tree verify step (up to 3 accepted nodes;
the bonus token past the budget is cut). Siblings are the head's top-ranked tokens, so the
verifier's rule for fixed siblings is the one exercised, at every depth. A planted bug (siblings
judged independently: a rejected sibling's token stays in the distribution the next sibling and
the recovered token are drawn from) must be rejected by the same statistics.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers import chi_square_pvalue
from test_lossless_engine import (
    BATCH,
    PROMPT,
    SAMPLING,
    VOCAB,
    _exact_joint,
    _streams,
    build_models,
    statistics,
)

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind
from specdec.proposers import EAGLETree
from specdec.verify import tree

F64 = torch.float64
POSITIONS = 4
NUM_BATCHES = 4
GREEDY_EVERY = 16
CASES = [("t1.0", "stream"), ("t0.8-topk8-topp0.9", "stream"), ("t1.0", "seeded")]
# Family-wise 1e-3 over the cases and the test of trees sized by min_path_prob.
ALPHA = 1e-3 / ((len(CASES) + 1) * len(statistics(POSITIONS)))


@pytest.fixture(scope="module")
def models():
    return build_models()


def _head(target) -> EagleHeadModel:
    torch.manual_seed(5)
    head = EagleHeadModel(target, EagleHeadConfig.for_target(target.config, EagleKind.EAGLE1))
    return head.to(F64).eval().requires_grad_(False)


def _peaky_head(target) -> EagleHeadModel:
    """A random EAGLE-3 head whose own LM head is scaled up: confident drafts (top
    probabilities ~0.3-0.9), so path probabilities spread over depths 1-3."""
    torch.manual_seed(6)
    cfg = EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=(0, 1, target.config.num_layers))
    head = EagleHeadModel(target, cfg)
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)
    return head.to(F64).eval().requires_grad_(False)


def sample(models, sampling: str, mode: str, min_path_prob: float = 0.0) -> tuple[torch.Tensor, Generator]:
    """[runs, 4] tokens emitted by the sampled requests; greedy ones ride along, checked.
    ``min_path_prob > 0``: the confident head of :func:`_peaky_head`, trees cut by the floor."""
    target = models[1]
    head = _peaky_head(target) if min_path_prob > 0 else _head(target)
    eagle = EAGLETree.from_model(head, None, top_k=3, depth=3, num_verify_tokens=21, min_path_prob=min_path_prob)
    gen = Generator.from_components(
        target,
        proposer=eagle,
        cache_config=CacheConfig(
            max_batch_size=BATCH, max_model_len=len(PROMPT) + POSITIONS, page_size=16, num_pages=2 * BATCH
        ),
        policy=FixedPolicy(21),
    )
    greedy = SamplingParams(max_new_tokens=POSITIONS, ignore_eos=True)
    plain_greedy = Generator.from_components(target).generate(PROMPT, greedy).token_ids
    sampled = []
    for b in range(NUM_BATCHES):
        params = [
            greedy
            if i % GREEDY_EVERY == GREEDY_EVERY - 1
            else SamplingParams(
                max_new_tokens=POSITIONS,
                ignore_eos=True,
                seed=b * BATCH + i if mode == "seeded" else None,
                **SAMPLING[sampling],
            )
            for i in range(BATCH)
        ]
        with _streams(first=b * BATCH):
            outs = gen.generate([PROMPT] * BATCH, params)
        for out, p in zip(outs, params):
            assert len(out.token_ids) == POSITIONS
            if p.is_greedy:
                assert out.token_ids == plain_greedy
            else:
                sampled.append(out.token_ids)
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]
    return torch.tensor(sampled), gen


def pvalues(models, sampling: str, mode: str, min_path_prob: float = 0.0) -> tuple[dict[str, float], Generator]:
    joint = _exact_joint(sampling, POSITIONS)
    tokens, gen = sample(models, sampling, mode, min_path_prob)
    counts = torch.zeros(*[VOCAB] * POSITIONS, dtype=F64)
    counts.index_put_(tuple(tokens.T), torch.ones(len(tokens), dtype=F64), accumulate=True)

    def marginal(t: torch.Tensor, keep: tuple[int, ...]) -> torch.Tensor:
        return t.sum(tuple(d for d in range(POSITIONS) if d not in keep))

    result = {}
    for name in statistics(POSITIONS):
        keep = tuple(int(x) - 1 for x in name.split()[1].split("-"))
        result[name] = chi_square_pvalue(marginal(counts, keep), marginal(joint, keep))
    return result, gen


@pytest.mark.parametrize(("sampling", "mode"), CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_eagle_tree_output_matches_the_target_distribution(models, sampling, mode):
    result, gen = pvalues(models, sampling, mode)
    assert min(result.values()) > ALPHA, result
    m = gen.metrics
    # Trees were kept at every depth, and rejected too.
    assert len(m.accepted_per_position) == 3 and all(a > 20 for a in m.accepted_per_position), m
    assert m.num_emitted_in_verify / m.num_verify_steps < 3.5


def test_trees_sized_by_min_path_prob_match_the_target_distribution(models):
    """Trees cut to the nodes whose path probability under a confident head reaches 0.05: fewer
    nodes, as many as the head's confidence allows each step, and still the target's
    distribution."""
    result, gen = pvalues(models, "t1.0", "stream", min_path_prob=0.05)
    assert min(result.values()) > ALPHA, result
    m = gen.metrics
    assert 1.5 < m.num_drafted / m.num_verify_steps < 15, m  # 21 nodes without the floor
    drafted, accepted = m.drafted_per_position, m.accepted_per_position
    assert 0 < drafted[2] < 0.6 * drafted[0], m  # depth 3 reached on some steps only
    assert accepted[0] > 20 and accepted[1] > 20, m


def _judged_independently(p, tokens):
    """Bug: every sibling tested against the target's p itself, and the recovered token drawn
    from p (a rejected sibling's token may come back)."""
    accept = torch.stack([p[t] for t in tokens]) if tokens else p.new_zeros(0)
    return accept, p.expand(len(tokens) + 1, -1)


def test_the_check_rejects_siblings_judged_independently(models):
    with mock.patch.object(tree, "sibling_step_deterministic", _judged_independently):
        result, _ = pvalues(models, "t1.0", "stream")
    assert min(result.values()) < ALPHA, result
