"""The speculation policy: expected emitted tokens, acceptance estimates, cost curves, and the
adaptive choice of k under synthetic step costs (no wall clock involved)."""

from __future__ import annotations

import itertools
import math
import random

import attrs
import pytest

from specdec import SamplingParams
from specdec.interfaces import DraftForecast, SpeculationContext, SpeculationPolicy
from specdec.policy import (
    AdaptivePolicy,
    AdaptivePolicyConfig,
    CostCurve,
    Extrapolation,
    FixedPolicy,
    acceptance_estimate,
    expected_emitted,
    position_hazards,
    survival,
)
from specdec.policy import cost_model as policy_module
from specdec.policy.tree import TreeSizer
from specdec.types import ProposalKind

GREEDY = SamplingParams(max_new_tokens=64)
MAX_K = 5


# ----------------------------------------------------------------------------- expected_emitted


@pytest.mark.parametrize(
    ("a", "k", "want"),
    [(0.0, 0, 1.0), (0.0, 5, 1.0), (0.5, 1, 1.5), (0.5, 2, 1.75), (0.8, 3, 2.952), (1.0, 4, 5.0)],
)
def test_expected_emitted_values(a, k, want):
    assert expected_emitted(a, k) == pytest.approx(want)


@pytest.mark.parametrize("a", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_expected_emitted_is_the_closed_form(a, k):
    assert expected_emitted(a, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


@pytest.mark.parametrize("k", [0, 1, 5])
def test_expected_emitted_limit_at_full_acceptance(k):
    assert expected_emitted(1.0, k) == k + 1
    assert expected_emitted(1.0 - 1e-12, k) == pytest.approx(k + 1)


@pytest.mark.parametrize(("a", "k"), [(-0.1, 2), (1.1, 2), (0.5, -1), (0.5, 1.5), (0.5, True)])
def test_expected_emitted_rejects_bad_input(a, k):
    with pytest.raises(ValueError, match=r"\b(a|k) must"):
        expected_emitted(a, k)


# ----------------------------------------------------------------------------- acceptance


def test_acceptance_estimate_is_the_truncated_geometric_mle():
    # Steps (drafted, accepted): (4, 4) (4, 1) (4, 2): 7 accepted, 2 rejections.
    assert acceptance_estimate(7, 2, prior=0.6, prior_weight=0) == pytest.approx(7 / 9)


def test_acceptance_estimate_prior():
    assert acceptance_estimate(0, 0, prior=0.6, prior_weight=2) == 0.6
    assert acceptance_estimate(0, 0, prior=0.3, prior_weight=0) == 0.3
    assert acceptance_estimate(8, 2, prior=0.5, prior_weight=2) == pytest.approx(9 / 12)


@pytest.mark.parametrize(
    "args", [(-1, 0, 0.5, 1), (1, -1, 0.5, 1), (1, 1, 1.5, 1), (1, 1, 0.5, -1)]
)
def test_acceptance_estimate_rejects_bad_input(args):
    with pytest.raises(ValueError):
        acceptance_estimate(*args)


def test_position_hazards_are_counts_with_a_prior_per_position():
    assert position_hazards([8.0, 3.0], [10.0, 4.0], [0.6, 0.6, 0.6], 0.0) == [0.8, 0.75, 0.6]
    assert position_hazards([0.0], [0.0], [0.7], 5.0) == [0.7]  # nothing judged: the prior
    assert position_hazards([1.0], [1.0], [0.5], 1.0) == [0.75]
    with pytest.raises(ValueError, match="prior_weight"):
        position_hazards([], [], [0.5], -1.0)


def test_survival_is_the_running_product_and_matches_the_geometric_model():
    assert survival([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    assert survival([]) == []
    for a, k in ((0.3, 4), (0.8, 6), (1.0, 3)):
        assert 1 + sum(survival([a] * k)) == pytest.approx(expected_emitted(a, k))


def test_policy_acceptance_decays_toward_recent_steps():
    policy = AdaptivePolicy(AdaptivePolicyConfig(decay=0.5, prior_weight=0.5))
    assert policy.acceptance(0) == pytest.approx(0.6)  # unseen request: the generator prior
    for _ in range(20):
        policy.choose(context(1))  # a step: evidence ages
        policy.observe_verify(0, 4, 4)
    high = policy.acceptance(0)
    assert high > 0.95
    for _ in range(10):
        policy.choose(context(1))
        policy.observe_verify(0, 4, 0)  # the draft starts failing
    assert policy.acceptance(0) < 0.25 < high
    policy.observe_verify(0, 0, 0)  # nothing drafted: nothing learned
    policy.release(0)
    assert policy.acceptance(0) == pytest.approx(policy.global_acceptance())


# ----------------------------------------------------------------------------- cost curves


def test_cost_curve_interpolates_between_measured_points():
    curve = CostCurve(decay=0.8)
    assert not curve.measured and curve.estimate(4) == 0.0
    curve.observe(1, 0.1)
    curve.observe(16, 0.4)
    assert curve.measured
    assert curve.estimate(1) == pytest.approx(0.1)
    assert curve.estimate(16) == pytest.approx(0.4)
    assert curve.estimate(6) == pytest.approx(0.1 + 0.3 * 5 / 15)


def test_cost_curve_is_monotone():
    curve = CostCurve(decay=0.8)
    curve.observe(2, 0.3)
    curve.observe(8, 0.2)  # noise: a cheaper measurement at more rows
    curve.observe(32, 0.9)
    sizes = [1, 2, 3, 5, 8, 13, 20, 32, 50, 100]
    values = [curve.estimate(s) for s in sizes]
    assert values == sorted(values)
    assert curve.estimate(8) == pytest.approx(0.3)


def test_cost_curve_extrapolation():
    proportional = CostCurve(decay=0.8, above=Extrapolation.PROPORTIONAL)
    flat = CostCurve(decay=0.8, above=Extrapolation.FLAT)
    for curve in (proportional, flat):
        curve.observe(4, 0.2)
        curve.observe(8, 0.3)
        # Below the smallest point: proportional to the size (optimistic for concave costs).
        assert curve.estimate(2) == pytest.approx(0.1)
    assert proportional.estimate(32) == pytest.approx(1.2)  # pessimistic
    assert flat.estimate(32) == pytest.approx(0.3)  # optimistic


def test_cost_curve_averages_within_a_bucket():
    curve = CostCurve(decay=0.5)
    curve.observe(20, 1.0)
    curve.observe(24, 2.0)  # same power-of-two bucket (16-31): (22, 1.5)
    curve.observe(1, 0.5)
    assert curve.estimate(22) == pytest.approx(1.5)
    curve.observe(3, float("nan"))  # ignored
    curve.observe(0, 1.0)  # ignored
    assert curve.estimate(22) == pytest.approx(1.5)


# Seconds of a pass of the packed bf16 kernel by rows, relative to one row (docs/performance.md,
# a 1536 x 17920 weight): flat to 6 rows (one block of rows), a step at 7.
# A prefill of 150 rows is compute-bound: about 25 one-row passes.
KERNEL_STEPS = {1: 1.00, 2: 1.03, 3: 1.18, 4: 1.23, 5: 1.24, 6: 1.32, 7: 1.75, 150: 25.0}


def _cost_errors(curve: CostCurve) -> dict[int, float]:
    for _ in range(20):  # a run's passes at k <= 6, k varying from step to step, and prefills
        for rows in (5, 7, 6, 1, 7, 5, 2, 150, 6, 3, 4):
            curve.observe(rows, KERNEL_STEPS[rows])
    return {r: abs(curve.estimate(r) / c - 1) for r, c in KERNEL_STEPS.items()}


def test_cost_curve_prices_each_small_row_count_on_its_own():
    """The kernel's cost steps from 6 to 7 rows; the curve prices both sides of the step."""
    errors = _cost_errors(CostCurve(decay=0.8))
    assert max(errors.values()) < 0.01


def test_negative_control_power_of_two_buckets_blur_the_kernel_step(monkeypatch):
    """With one bucket per power of two (the policy before 2026-12-01), 5, 6 and 7 rows share a
    point: 7 rows is priced under its cost, 5 and 6 rows over theirs."""
    monkeypatch.setattr(policy_module, "cost_bucket", lambda size: int(math.log2(size)))
    errors = _cost_errors(CostCurve(decay=0.8))
    assert errors[6] > 0.05 and errors[7] > 0.05 and errors[5] > 0.05


def test_cost_curve_rejects_bad_decay():
    with pytest.raises(ValueError, match="decay"):
        CostCurve(decay=1.0)


# ----------------------------------------------------------------------------- synthetic costs


def memory_bound(policy: AdaptivePolicy) -> None:
    """A step costs about the same for 1 or 64 rows; drafting a token costs 5% of a step."""
    for rows in (*range(1, 16), 16, 32, 64, 128):  # every cost bucket measured
        policy.observe_target(rows, 0.100 + 0.0002 * rows)
    for batch in (1, 2, 4, 8, 16, 32):
        policy.observe_propose(batch, 1, 0.005 + 0.0001 * batch, unseen=0)


def compute_bound(policy: AdaptivePolicy) -> None:
    """Every row costs its full price; a draft token costs a third of a target row."""
    for rows in (*range(1, 16), 16, 32, 64, 128, 256):  # every cost bucket measured
        policy.observe_target(rows, 0.01 * rows)
    for batch in (1, 2, 4, 8, 16, 32):
        policy.observe_propose(batch, 1, 0.003 * batch, unseen=0)


def accepting(policy: AdaptivePolicy, seq_id: int, accepted: int, drafted: int = 4, n: int = 30):
    for _ in range(n):
        policy.observe_verify(seq_id, drafted, accepted)


def context(batch: int, caps: int | list[int] = 100, params=GREEDY, unseen: int = 0):
    caps = [caps] * batch if isinstance(caps, int) else caps
    return SpeculationContext(
        seq_ids=tuple(range(batch)),
        params=(params,) * batch,
        caps=tuple(caps),
        unseen=(unseen,) * batch,
        max_k=MAX_K,
    )


def estimated_rate(policy: AdaptivePolicy, ctx: SpeculationContext, ks) -> float:
    """Expected emitted tokens per second of plan ``ks`` under the policy's cost estimates."""
    emitted = sum(policy.expected_emitted(s, k) for s, k in zip(ctx.seq_ids, ks))
    drafting = sum(k > 0 for k in ks)
    return emitted / policy.step_seconds(sum(k + 1 for k in ks), drafting, max(ks))


def test_policies_implement_the_protocol():
    assert isinstance(AdaptivePolicy(), SpeculationPolicy)
    assert isinstance(FixedPolicy(3), SpeculationPolicy)


def test_memory_bound_and_high_acceptance_drafts_the_maximum_at_batch_1():
    policy = AdaptivePolicy()
    memory_bound(policy)
    accepting(policy, 0, accepted=4)
    assert policy.choose(context(1)) == (MAX_K,)


def test_compute_bound_switches_speculation_off_at_batch_32():
    policy = AdaptivePolicy()
    compute_bound(policy)
    for s in range(32):
        accepting(policy, s, accepted=4)  # even drafts that are always right do not pay
    assert policy.choose(context(32)) == (0,) * 32


def test_compute_bound_still_speculates_at_batch_1_when_drafts_are_good():
    # One row costs 10 ms, but so do two: the model is linear only from the origin; here
    # speculation pays only if cheap rows exist, so a compute-bound target never speculates...
    policy = AdaptivePolicy()
    compute_bound(policy)
    accepting(policy, 0, accepted=4)
    assert policy.choose(context(1)) == (0,)
    # ... while a target with a fixed cost per step (weights read once per step) does.
    policy.observe_target(1, 0.100)
    policy.observe_target(8, 0.110)
    assert policy.choose(context(1))[0] > 0


def test_low_acceptance_request_is_left_out_of_a_speculating_batch():
    policy = AdaptivePolicy()
    for rows in (1, 2, 4, 8, 16):
        policy.observe_target(rows, 0.100 + 0.004 * rows)
    for batch in (1, 2, 4):
        policy.observe_propose(batch, 1, 0.010 * batch, unseen=0)
    accepting(policy, 0, accepted=4)  # always right
    accepting(policy, 1, accepted=0)  # always wrong
    ks = policy.choose(context(2))
    assert ks[0] > 0 and ks[1] == 0


def test_one_unlucky_step_does_not_switch_a_good_request_off():
    """Measured on the Qwen pair at batch 1 (one thread): a draft token costs half a target
    step, so speculation gains ~10%; a request's first step rejecting every draft must not
    end its speculation when the generator's drafts are usually right."""
    policy = AdaptivePolicy()
    for rows, seconds in ((1, 0.26), (2, 0.30), (4, 0.36), (8, 0.62), (32, 1.8)):
        policy.observe_target(rows, seconds)
    policy.observe_propose(1, 1, 0.13, unseen=0)
    for s in range(100, 110):  # earlier requests: about 0.85 acceptance
        for _ in range(5):
            policy.observe_verify(s, 3, 3)
        policy.observe_verify(s, 3, 1)
    policy.observe_verify(0, 3, 0)
    assert policy.choose(context(1))[0] > 0
    for _ in range(4):  # but a request that keeps failing is switched off
        policy.observe_verify(0, 1, 0)
    assert policy.choose(context(1)) == (0,)


def test_caps_and_max_k_bound_the_choice():
    policy = AdaptivePolicy()
    memory_bound(policy)
    for s in range(3):
        accepting(policy, s, accepted=4)
    ks = policy.choose(context(3, caps=[0, 2, 100]))
    assert ks == (0, 2, MAX_K)


def test_plan_is_close_to_the_brute_force_optimum():
    policy = AdaptivePolicy()
    for rows in (1, 2, 4, 8, 16, 32):
        policy.observe_target(rows, 0.05 + 0.006 * rows)
    for batch in (1, 2, 3, 4):
        policy.observe_propose(batch, 1, 0.008 + 0.002 * batch, unseen=0)
    for s, accepted in enumerate((4, 3, 1)):
        accepting(policy, s, accepted=accepted)
    ctx = SpeculationContext(
        seq_ids=(0, 1, 2), params=(GREEDY,) * 3, caps=(3, 3, 3), unseen=(0, 0, 0), max_k=3
    )
    best = max(estimated_rate(policy, ctx, ks) for ks in itertools.product(range(4), repeat=3))
    chosen = estimated_rate(policy, ctx, policy.choose(ctx))
    assert chosen >= 0.99 * best


def mixture_rate(k: int, easy: float, hard: float, share: float, draft_share: float) -> float:
    """True emitted tokens per second at fixed ``k`` when a step's drafts follow ``easy``
    acceptance with probability ``share`` and ``hard`` otherwise (a stretch of boilerplate or
    of new code), a step costing ``0.1 + 0.002 * rows`` s and a draft ``draft_share`` of 0.1 s."""
    emitted = 1 + sum(share * easy**j + (1 - share) * hard**j for j in range(1, k + 1))
    return emitted / (0.1 + 0.002 * (k + 1) + draft_share * 0.1 * k)


def mixture_policy(easy: float, hard: float, share: float, draft_share: float) -> AdaptivePolicy:
    """A policy that has measured those costs and 400 steps of 8 drafts from that mixture."""
    policy = AdaptivePolicy()
    for rows in (*range(1, 16), 16, 32, 64):
        policy.observe_target(rows, 0.1 + 0.002 * rows)
    policy.observe_propose(1, 1, draft_share * 0.1, unseen=0)
    rng = random.Random(0)
    for s in range(20):
        for _ in range(20):
            a = easy if rng.random() < share else hard
            accepted = 0
            while accepted < 8 and rng.random() < a:
                accepted += 1
            policy.observe_verify(s, 8, accepted)
    return policy


def test_position_acceptances_price_long_drafts_in_mixed_text():
    """Easy and hard stretches: a draft after accepted drafts is likelier right than the first
    (position hazards rise), so one acceptance for all positions under-prices long drafts."""
    args = (0.99, 0.2, 0.5, 0.15)
    policy = mixture_policy(*args)
    hazards = policy.global_hazards(8)
    assert hazards[0] < 0.7 < 0.9 < min(hazards[2:])
    rates = {k: mixture_rate(k, *args) for k in range(9)}
    ctx = SpeculationContext(seq_ids=(99,), params=(GREEDY,), caps=(100,), unseen=(0,), max_k=8)
    (k,) = policy.choose(ctx)
    assert rates[k] >= 0.98 * max(rates.values())


def test_negative_control_one_acceptance_for_every_position_drafts_too_little():
    """The geometric model (one acceptance, a^j for the j-th draft) picks a shorter draft on
    the same mixture and loses more than the test above allows."""
    args = (0.99, 0.2, 0.5, 0.15)
    policy = mixture_policy(*args)
    a = policy.global_acceptance()
    geometric = max(
        range(9), key=lambda k: expected_emitted(a, k) / policy.step_seconds(k + 1, k > 0, k)
    )
    rates = {k: mixture_rate(k, *args) for k in range(9)}
    assert rates[geometric] < 0.96 * max(rates.values())


def test_survival_shrinks_a_request_toward_the_generator_per_position():
    policy = AdaptivePolicy()
    assert policy.survival(5, 3) == pytest.approx([0.6, 0.36, 0.216])  # the prior throughout
    for _ in range(40):
        policy.observe_verify(0, 4, 4)  # request 0 always right
        policy.observe_verify(1, 4, 0)  # request 1 always wrong at the first draft
    good, bad = policy.survival(0, 4), policy.survival(1, 4)
    assert good[0] > 0.8 and bad[0] < 0.2  # ~10 decayed steps against 5 prior ones
    assert all(x >= y for x, y in itertools.pairwise(good))  # never rises with j
    assert policy.expected_emitted(0, 4) == pytest.approx(1 + sum(good))
    policy.release(1)
    assert policy.survival(1, 4) == pytest.approx(policy.survival(7, 4))  # back to the generator's


def test_negative_control_cost_blind_policy_loses_under_compute_bound_costs():
    """Always drafting the maximum (ignoring cost) is clearly worse here, so the comparison
    above and the batch-32 test can fail."""
    policy = AdaptivePolicy()
    compute_bound(policy)
    for s in range(32):
        accepting(policy, s, accepted=3)
    ctx = context(32)
    adaptive = estimated_rate(policy, ctx, policy.choose(ctx))
    blind = estimated_rate(policy, ctx, FixedPolicy(MAX_K).choose(ctx))
    assert blind < 0.8 * adaptive


def test_fixed_policy_drafts_its_k_within_caps():
    assert FixedPolicy(3).choose(context(3, caps=[0, 2, 10])) == (0, 2, 3)
    assert FixedPolicy(9).choose(context(1)) == (MAX_K,)  # never past the step's max_k
    assert FixedPolicy(0).choose(context(2)) == (0, 0)


@pytest.mark.parametrize(("k", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_fixed_policy_rejects_bad_k(k, error):
    with pytest.raises(error, match="k must"):
        FixedPolicy(k)


def test_no_costs_measured_means_a_plain_step():
    assert AdaptivePolicy().choose(context(2)) == (0, 0)


# ----------------------------------------------------------------------------- this CPU, cold


def convex(rows: int) -> float:
    """Seconds of a target pass on this project's CPU (1.5B bf16, one thread, profile of
    2026-12-01): flat up to 6 rows (weight reads), then each row costs its compute."""
    return 0.270 + 0.018 * max(0, rows - 1) + 0.035 * max(0, rows - 6)


def test_cost_curve_optimistic_prices_unmeasured_buckets_from_below():
    curve = CostCurve(decay=0.8)
    curve.observe(1, convex(1))
    curve.observe(150, convex(150))
    # The chord from 1 to 150 rows prices a 5-row verify pass 40% above its cost...
    assert curve.estimate(5) > 1.3 * convex(5)
    # ... optimism prices it like the measured step below it, until it is measured.
    assert curve.estimate(5, optimistic=True) == convex(1)
    curve.observe(5, convex(5))
    assert curve.estimate(5, optimistic=True) == pytest.approx(convex(5))
    # 6 rows, not measured: 5 rows' cost grown along the chord from 1 to 5 rows, a lower bound.
    assert curve.estimate(6, optimistic=True) == pytest.approx(convex(5) + (convex(5) - convex(1)) / 4)
    assert convex(5) < curve.estimate(6, optimistic=True) <= convex(6) + 1e-12
    # 15 rows priced like 5 would make a batch of 4 draft 11 tokens "for free" (the old flat rule).
    assert curve.estimate(15, optimistic=True) > convex(5) + 9 * 0.018 - 1e-9
    curve.observe(20, convex(20))
    assert curve.estimate(24, optimistic=True) == curve.estimate(24)  # same bucket (16-31): measured
    assert curve.estimate(64, optimistic=True) == curve.estimate(64)  # between 20 and 150: the chord
    assert curve.estimate(200, optimistic=True) == curve.estimate(200)  # 150's bucket: measured
    # Above all: 150's cost grown along the chord from 1 to 150 rows (below the convex cost).
    assert convex(150) < curve.estimate(300, optimistic=True) < convex(300)
    assert curve.estimate(300) > convex(150)  # (not optimistic: as configured, proportional)
    assert curve.measured_at(5) and not curve.measured_at(9) and not curve.measured_at(0.5)


def steep(rows: int) -> float:
    """A more convex curve (the integration test's slowed target): flat up to 8 rows, then
    each row costs what a whole decode step does."""
    return 0.020 + 0.020 * max(0, rows - 8)


@pytest.mark.parametrize(("cost", "prompt"), [(convex, 150), (steep, 30)])
def test_a_cold_policy_tries_speculating_on_a_convex_cost(cost, prompt):
    policy = AdaptivePolicy()
    policy.observe_target(prompt, cost(prompt))
    policy.observe_target(1, cost(1))
    (k,) = policy.choose(context(1, unseen=prompt + 1))
    assert k > 0


def test_negative_control_the_chord_never_tries_on_the_steep_curve():
    """Priced by the chord from one row to the prefill (the 2026-11-30 policy), the same cold
    policy stays plain: the test above is what catches that policy."""
    policy = AdaptivePolicy()
    policy.observe_target(30, steep(30))
    policy.observe_target(1, steep(1))
    policy.step_seconds = lambda rows, drafting, width: (  # the pre-fix estimate
        policy.target_cost.estimate(rows) + policy.draft_cost.estimate(drafting) * width
    )
    assert policy.choose(context(1, unseen=31)) == (0,)


def test_once_measured_the_convex_curve_picks_the_best_k():
    policy = AdaptivePolicy()
    for rows in (1, 2, 3, 5, 7, 9, 17, 33, 150):
        policy.observe_target(rows, convex(rows))
    policy.observe_propose(1, 1, 0.100, unseen=0)  # a 0.5B draft forward
    accepting(policy, 0, accepted=4, drafted=5, n=60)  # a = 0.8
    ctx = context(1)
    (k,) = policy.choose(ctx)
    rates = {j: estimated_rate(policy, ctx, (j,)) for j in range(MAX_K + 1)}
    assert k == max(rates, key=rates.get) and k > 0


def test_a_cold_policy_stops_where_speculation_cannot_pay():
    """Every row costs its full price (compute-bound): after trying each row count once with
    perfect drafts, the policy decodes plainly."""
    policy = AdaptivePolicy()
    policy.observe_target(150, 0.01 * 150)
    policy.observe_target(1, 0.01)
    tries = 0
    for _ in range(40):
        (k,) = policy.choose(context(1))
        if k:
            tries += 1
            policy.observe_propose(1, k, 0.003 * k, unseen=0)
            policy.observe_verify(0, k, k)
        policy.observe_target(k + 1, 0.01 * (k + 1))
    assert 1 <= tries <= MAX_K  # each row count 2..MAX_K+1 at most once
    assert policy.choose(context(1)) == (0,)


def test_a_cold_batch_lets_one_request_price_the_proposer():
    policy = AdaptivePolicy()
    policy.observe_target(150, convex(150))  # a prefill and a plain step
    policy.observe_target(1, convex(1))
    ks = policy.choose(
        SpeculationContext(
            seq_ids=(0, 1, 2), params=(GREEDY,) * 3, caps=(100,) * 3, unseen=(151, 40, 90), max_k=MAX_K
        )
    )
    assert ks[1] > 0 and ks[0] == ks[2] == 0


# ----------------------------------------------------------------------------- probing


def probing_policy(**config) -> AdaptivePolicy:
    """Batch 1, free drafting (a prompt lookup), a second target row costing 10 ms, and a
    request whose drafts always fail: it should sit at k = 0 and be probed now and then."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(**config))
    policy.observe_target(1, 0.110)
    policy.observe_target(2, 0.120)
    policy.observe_target(4, 0.140)
    policy.observe_propose(1, 1, 0.0, unseen=0)
    accepting(policy, 0, accepted=0, n=50)
    return policy


def test_probes_come_at_the_budgeted_cadence():
    policy = probing_policy(prior_weight=0.5)
    a = policy.acceptance(0)
    assert a < 0.02
    # A probe adds 10 ms to a 110 ms step and is expected to emit a more tokens; at a 1% budget
    # it is due once the request has spent (0.010 - a * 0.110) / (0.01 * 0.110) steps at k = 0.
    due = math.ceil((0.010 - a * 0.110) / (0.01 * 0.110))
    assert due == 10
    ks = [policy.choose(context(1))[0] for _ in range(40)]
    assert [i + 1 for i, k in enumerate(ks) if k] == [10, 20, 30, 40]
    assert set(ks) == {0, 1}


def test_probe_cadence_follows_the_budget():
    policy = probing_policy(probe_budget=0.1)  # 10x the budget: due after 1 step -> 8 (min)
    ks = [policy.choose(context(1))[0] for _ in range(24)]
    assert [i + 1 for i, k in enumerate(ks) if k] == [8, 16, 24]


def test_probe_accounts_for_the_proposer_catching_up():
    policy = AdaptivePolicy()
    for rows in (1, 2, 4, 512):
        policy.observe_target(rows, 0.100 + 0.010 * rows)
    policy.observe_propose(1, 1, 0.050, unseen=0)  # a draft model: 50 ms a token
    accepting(policy, 0, accepted=0, n=50)
    # Each step at k = 0 leaves one more token for the draft model to catch up on, which
    # costs more than 1% of a step: probing never fits the budget (while the 50 rejections
    # still weigh: evidence ages, see test_unlucky_rejections_do_not_switch_speculation_off).
    ks = [policy.choose(context(1, unseen=1 + i))[0] for i in range(40)]
    assert ks == [0] * 40
    # A free proposer (nothing to catch up on) is probed in the same situation.
    policy.observe_propose(1, 1, 0.0, unseen=0)
    policy.draft_cost = CostCurve(0.0, Extrapolation.FLAT)
    policy.draft_cost.observe(1, 0.0)
    assert 1 in [policy.choose(context(1, unseen=1 + i))[0] for i in range(40)]


def test_no_probes_where_speculation_cannot_pay():
    policy = AdaptivePolicy()
    compute_bound(policy)
    ks = [policy.choose(context(32)) for _ in range(300)]
    assert all(k == (0,) * 32 for k in ks)


def test_observe_propose_takes_out_the_catch_up():
    policy = AdaptivePolicy()
    compute_bound(policy)
    ratio = 0.3  # the draft costs 0.3 of the target per row
    unseen, width = 100, 4
    seconds = ratio * (0.01 * (unseen + 1) + (width - 1) * 0.01)
    policy.observe_propose(1, width, seconds, unseen=unseen)
    # The per-token cost at batch 1 is what steady-state drafting costs: ratio * T(1).
    assert policy.draft_cost.estimate(1) == pytest.approx(ratio * 0.01)
    assert policy.catchup_seconds(unseen) == pytest.approx(ratio * 0.01 * unseen)


def test_catch_up_is_learned_from_propose_calls_once_drafting_is_measured():
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    memory_bound(policy)  # 5.1 ms a drafted token at batch 1
    policy.observe_propose(1, 4, 4 * 0.0051 + 0.600, unseen=120)
    assert policy.catchup_seconds(120) == pytest.approx(0.600)
    assert policy.catchup_seconds(60) == pytest.approx(0.300)  # proportional below
    assert policy.draft_cost.estimate(1) == pytest.approx(0.0051)  # drafting unchanged


def switching_context(unseen: int, cap: int) -> SpeculationContext:
    return SpeculationContext(
        seq_ids=(0,), params=(GREEDY,), caps=(cap,), unseen=(unseen,), max_k=MAX_K
    )


def test_catch_up_is_paid_only_where_the_remaining_tokens_repay_it():
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    memory_bound(policy)
    policy.observe_propose(1, 4, 4 * 0.0051 + 1.0, unseen=100)  # 1 s to catch up on 100 tokens
    accepting(policy, 0, accepted=3)
    # Drafting saves ~0.06 s a token here; a catch-up of 1 s needs many tokens to pay off.
    assert policy.choose(switching_context(unseen=100, cap=5)) == (0,)
    assert policy.choose(switching_context(unseen=100, cap=500))[0] > 0
    assert policy.choose(switching_context(unseen=0, cap=5))[0] > 0  # nothing to catch up on


def test_a_catch_up_costs_the_same_per_token_at_any_k():
    """Measured on a q4 pair at two threads (AMD EPYC, benchmarks/policy_replay.py): a verify
    row costs ~0.4 of a plain step, a drafted token 0.43, so only k = 1 pays, and a new
    request's draft must first catch up on its 95-token prompt (0.32 s). Spread over the
    request's 127 tokens that is 2.5 ms a token, and k = 1 beats plain (27.9 against 31 ms a
    token); priced per step at the widest k's pace it looked three times dearer, and every
    request after the first decoded plain."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    target = {1: 0.0310, 2: 0.0359, 3: 0.0487, 4: 0.0640, 5: 0.0797, 6: 0.0902}
    for rows, seconds in target.items():
        policy.observe_target(rows, seconds)
    policy.observe_propose(1, 1, 0.0132, unseen=0)
    policy.observe_propose(1, 1, 0.0132 + 0.0033 * 110, unseen=110)  # the first request's
    for n in range(60):  # the first request: 9 in 10 first drafts accepted
        policy.observe_verify(0, 1, int(n % 10 != 0))
    policy.release(0)
    new_request = SpeculationContext(seq_ids=(1,), params=(GREEDY,), caps=(126,), unseen=(95,), max_k=MAX_K)
    assert policy.choose(new_request) == (1,)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("decay", 1.0, ValueError),
        ("decay", -0.1, ValueError),
        ("global_decay", 1.5, ValueError),
        ("prior_acceptance", 1.5, ValueError),
        ("prior_weight", 0, ValueError),
        ("cost_decay", math.nan, ValueError),
        ("probe_budget", 0.0, ValueError),
        ("probe_budget", "1%", TypeError),
        ("min_probe_interval", 0, ValueError),
        ("min_probe_interval", 2.5, TypeError),
    ],
)
def test_bad_config_names_the_field(field, value, error):
    with pytest.raises(error, match=field):
        AdaptivePolicyConfig(**{field: value})


def test_the_removed_seeded_sampling_knob_is_refused_by_name():
    """Seeded requests no longer need a pinned k (their tokens do not depend on k), so the
    knob is gone; passing it fails loudly rather than being ignored."""
    with pytest.raises(TypeError, match="fixed_k_for_seeded_sampling"):
        AdaptivePolicyConfig(fixed_k_for_seeded_sampling=True)


def test_adaptive_policy_takes_only_its_config():
    with pytest.raises(TypeError, match="config must be an AdaptivePolicyConfig"):
        AdaptivePolicy({"decay": 0.5})


def test_release_forgets_the_request():
    policy = probing_policy()
    policy.choose(context(1))
    assert 0 in policy._requests
    policy.release(0)
    assert policy._requests == {}


# ----------------------------------------------------------------------------- trees


def tree_context(
    batch: int, max_k: int = 16, caps: int = 100, unseen: int = 0, remaining: int | None = None
) -> SpeculationContext:
    return SpeculationContext(
        seq_ids=tuple(range(batch)),
        params=(GREEDY,) * batch,
        caps=(caps,) * batch,
        unseen=(unseen,) * batch,
        max_k=max_k,
        kind=ProposalKind.TREE,
        remaining=() if remaining is None else (remaining,) * batch,
    )


def flat_then_linear(policy: AdaptivePolicy, flat_rows: int = 8, base: float = 0.100) -> None:
    """This CPU's target cost: ~flat up to a few rows, then linear (convex)."""
    for rows in (1, 2, 4, 8, 16, 32, 64):
        policy.observe_target(rows, base * max(1.0, rows / flat_rows))


def test_an_unmeasured_drafting_batch_is_priced_as_the_target_scales():
    """The draft's cost at a batch it never drafted for is its largest measured batch's, grown
    as the target's pass grows over as many rows (flat where the target is flat). Priced flat
    from a batch-1 step, a cold batch-4 step on a 1-thread CPU (the target's 4-row pass 3x
    its 1-row one) started four requests drafting, with four catch-ups, and ran at 0.90x
    plain; measured at batch 4, the real cost decides."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    for rows, seconds in ((1, 0.07), (2, 0.14), (4, 0.21), (8, 0.26)):
        policy.observe_target(rows, seconds)
    policy.observe_propose(1, 1, 0.03, unseen=0)  # one request drafted one token: 0.03 s
    assert policy.draft_per_token(1) == pytest.approx(0.03)
    assert policy.draft_per_token(4) == pytest.approx(0.03 * 0.21 / 0.07)  # not 0.03
    assert policy.choose(context(4)) == (0, 0, 0, 0)  # at 0.03 a token, k = 1 for all would pay
    policy.observe_propose(4, 1, 0.03, unseen=0)  # measured: as cheap as one request's
    assert policy.draft_per_token(4) == pytest.approx(0.03)
    assert any(policy.choose(context(4)))
    trees = policy.trees  # the same for trees, per size bucket
    trees.observe_propose(1, 16, 0.05)
    assert trees.draft_seconds(16, 4, policy.target_cost) == pytest.approx(0.05 * 0.21 / 0.07)
    assert trees.draft_seconds(16, 1, policy.target_cost) == pytest.approx(0.05)
    flat = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))  # a GPU: the target is flat
    for rows in (1, 2, 4, 8):
        flat.observe_target(rows, 0.02)
    flat.observe_propose(1, 1, 0.005, unseen=0)
    assert flat.draft_per_token(4) == pytest.approx(0.005)


def test_several_costly_catch_ups_start_one_request_per_step():
    """Drafting pays here, but starting four requests at once would sink four catch-ups (each
    more than a plain step) before anything says it pays at this batch: the request with the
    least to catch up on starts alone. Cheap catch-ups (a few tokens) start together."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    for rows, seconds in ((1, 0.10), (4, 0.11), (8, 0.12), (16, 0.14), (64, 0.50)):
        policy.observe_target(rows, seconds)
    for batch in (1, 4):
        policy.observe_propose(batch, 1, 0.01, unseen=0)
    policy.catchup_cost.observe(40, 0.3)  # 40 tokens: 0.3 s, about three plain steps
    for _ in range(20):
        policy.observe_verify(9, 4, 4)  # the generator's drafts are good
    ctx = SpeculationContext(seq_ids=(0, 1, 2, 3), params=(GREEDY,) * 4, caps=(400,) * 4,
                             unseen=(41, 40, 45, 50), max_k=MAX_K)  # fmt: skip
    ks = policy.choose(ctx)
    assert ks[1] > 0 and ks[0] == ks[2] == ks[3] == 0, ks
    cheap = SpeculationContext(seq_ids=(4, 5, 6, 7), params=(GREEDY,) * 4, caps=(400,) * 4,
                               unseen=(3, 3, 3, 3), max_k=MAX_K)  # fmt: skip
    assert all(policy.choose(cheap))


def test_a_held_back_start_leaves_a_plan_that_must_beat_plain_on_its_own():
    """Measured on a 1-thread CPU at batch 4: four requests starting together price above a
    plain step (the draft's forward shared four ways), but their catch-ups (0.21 s each) would
    sink four plain steps at once, so only one may start; drafting for that one alone pays the
    whole draft forward for one row and prices below plain: nobody starts (the old code kept
    the one start, at 16.5 tokens/s against plain's 19.3 by its own estimate)."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    for rows, seconds in ((1, 0.189), (4, 0.207), (8, 0.255), (16, 0.33)):
        policy.observe_target(rows, seconds)
    policy.observe_propose(1, 1, 0.069, unseen=0)
    policy.observe_propose(4, 1, 0.075, unseen=0)
    policy.catchup_cost.observe(33, 0.21)
    for accepted in (1, 1, 1, 1, 1, 1, 1, 1, 0) * 4:
        policy.observe_verify(9, 1, accepted)
    assert 0.85 < policy.global_acceptance() < 0.9
    ctx = SpeculationContext(seq_ids=(0, 1, 2, 3), params=(GREEDY,) * 4, caps=(48,) * 4,
                             unseen=(33, 34, 35, 36), max_k=1)  # fmt: skip
    base = policy.global_hazards(1)
    surv = [policy._survival(s, base) for s in ctx.seq_ids]
    switch = [policy._catchup_per_token(ctx, r) for r in range(4)]
    plain = policy._plan_rate(surv, switch, [0] * 4)
    assert policy._plan_rate(surv, switch, [1] * 4) > plain  # together: worth it on paper
    assert policy._plan_rate(surv, switch, [1, 0, 0, 0]) < plain  # alone: not
    assert policy.choose(ctx) == (0, 0, 0, 0)


def forecast_context(forecast, batch: int = 1, max_k: int = 16) -> SpeculationContext:
    return attrs.evolve(tree_context(batch, max_k=max_k, remaining=100), forecast=forecast)


def forecast_policy() -> AdaptivePolicy:
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    for rows, seconds in ((1, 0.100), (2, 0.101), (3, 0.102), (5, 0.105), (9, 0.130), (17, 0.200)):
        policy.observe_target(rows, seconds)
    return policy


def test_forecasts_price_the_nodes_a_request_drafts_not_the_nodes_allowed():
    """A 4-chain model drafts 4 nodes however many a step allows: priced by the forecast, 16
    allowed nodes cost 5 verify rows, not 17 (without forecasts the sizer priced 17 and chose
    small trees where the hybrid's suffix trees could have drafted 16). The model's drafting
    time is keyed by its own nodes and the requests it drafts for."""
    policy = forecast_policy()
    accepted = [0.0, 0.8, 1.5, 2.1, 2.6]

    def model(n):
        return (DraftForecast(min(n, 4), accepted[min(n, 4)], model=True),)

    policy.trees.model_node_cost.observe(1, 0.0075)  # the model's 4-chain for one request: 0.03 s
    ks = policy.choose(forecast_context(model))
    assert ks[0] >= 4 and policy.trees.planned == (4, 1, 0), ks
    policy.observe_propose(1, ks[0], 0.05, unseen=0)  # timed as the model's 4 nodes, 1 request
    assert policy.trees.forecast_draft_seconds(4, 1, 1) == pytest.approx(0.05)
    assert policy.trees.forecast_draft_seconds(2, 1, 1) == pytest.approx(0.025)  # per node
    # Also by the size asked for: the sizer's own table at batch > 1 (left empty, a batch-4
    # step after batch-1 forecasts priced drafting free and drafted at 0.90x plain).
    assert policy.trees.draft_seconds(ks[0], 1) == pytest.approx(0.05)
    # Without the forecast the same accepted lengths at 16 nodes price 17 rows: smaller wins.
    plain = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    for rows, seconds in ((1, 0.100), (2, 0.101), (3, 0.102), (5, 0.105), (9, 0.130), (17, 0.200)):
        plain.observe_target(rows, seconds)
    plain.choose(tree_context(1))  # a tree context: observations go to the tree model
    plain.observe_propose(1, 4, 0.03, unseen=0)
    for n in (1, 2, 4, 8, 16):
        for _ in range(10):
            plain.observe_verify(0, n, accepted[min(n, 4)])
    assert plain.choose(tree_context(1)) == (4,)


def test_forecast_suffix_lookups_are_timed_apart_from_the_model():
    """A step where only suffix trees draft (no model forward) times the lookups; the model's
    drafting cost is untouched by it."""
    policy = forecast_policy()

    def suffix(n):
        return (DraftForecast(n, 0.9 * n, model=False),)

    assert policy.choose(forecast_context(suffix)) == (16,)
    assert policy.trees.planned == (0, 0, 0)
    policy.observe_propose(1, 16, 0.002, unseen=0)
    assert policy.trees.lookup_cost is not None and policy.trees.lookup_cost.estimate(1) == pytest.approx(0.002)
    assert not policy.trees.model_node_cost.measured


def test_tree_starts_are_staggered_and_what_is_left_must_beat_plain():
    """Trees, batch 4, four fresh prompts: all four drafting prices above plain on paper, but
    their catch-ups (0.21 s each) would sink four plain steps at once; one request alone does
    not pay the draft's forward, so nobody starts (the old sizer started all four: 0.92x plain
    on a 1-thread Xeon). With a better accepted length one request starts alone."""
    def sized(accepted: float) -> AdaptivePolicy:
        policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
        policy.choose(tree_context(1))  # a tree context: observations go to the tree model
        for rows, seconds in ((1, 0.189), (4, 0.207), (5, 0.21), (8, 0.26), (16, 0.40), (20, 0.47)):
            policy.observe_target(rows, seconds)
        for n, one, four in ((1, 0.05, 0.06), (2, 0.06, 0.07), (4, 0.07, 0.08)):
            policy.trees.observe_propose(1, n, one)
            policy.trees.observe_propose(4, n, four)
        policy.catchup_cost.observe(33, 0.21)
        for n, length in ((1, 0.75), (2, 1.3), (4, accepted)):
            for _ in range(30):
                policy.observe_verify(9, n, length)
        return policy

    fresh = attrs.evolve(tree_context(4, max_k=4, remaining=48), unseen=(33, 34, 35, 36))
    assert sized(2.0).choose(fresh) == (0, 0, 0, 0)
    assert sized(3.0).choose(fresh) == (4, 0, 0, 0)
    cheap = attrs.evolve(fresh, unseen=(2, 2, 2, 2))  # drafted last step: nothing to catch up
    ks = sized(2.0).choose(cheap)
    assert ks[0] > 0 and len(set(ks)) == 1, ks


def test_forecasts_size_a_lone_request_only():
    """At batch > 1 the sizer keeps its own accepted lengths per size: a closed batch ends
    with its slowest request, and forecasts that sped one request up (a repeat) cost a
    four-request run 9 % against plain."""
    policy = forecast_policy()
    asked = []

    def suffix(n):
        asked.append(n)
        return (DraftForecast(n, 0.9 * n, model=False),) * 2

    policy.choose(forecast_context(suffix, batch=2))
    assert asked == [] and policy.trees.planned is None and not policy.trees.forecasting


def test_weak_forecasts_keep_the_step_plain():
    policy = forecast_policy()

    def weak(n):
        return (DraftForecast(n, 0.01 * n, model=False),)

    assert policy.choose(forecast_context(weak)) == (0,)
    assert policy.trees.planned is None


def test_tree_sizes_are_powers_of_two_and_the_whole_tree():
    assert TreeSizer.sizes(16) == [1, 2, 4, 8, 16]
    assert TreeSizer.sizes(20) == [1, 2, 4, 8, 16, 20]
    assert TreeSizer.sizes(1) == [1]


def test_a_fresh_policy_tries_the_whole_tree_after_one_plain_step():
    policy = AdaptivePolicy()
    assert policy.choose(tree_context(1)) == (0,)  # no cost known: a plain step measures one
    policy.observe_target(1, 0.1)
    assert policy.choose(tree_context(1)) == (16,)  # unmeasured: priced optimistically


def test_unmeasured_tree_sizes_are_tried_once_then_the_measured_best_wins():
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    policy.choose(tree_context(1))
    policy.observe_target(1, 0.100)
    policy.observe_target(17, 0.180)  # a 16-node verify pass costs 1.8x here
    policy.observe_propose(1, 16, 0.030, unseen=0)
    for _ in range(20):
        policy.observe_verify(0, 16, 3)
    # 8 nodes: not measured, priced at the 1-row cost with 16 nodes' accepted length: tried.
    assert policy.choose(tree_context(1)) == (8,)
    policy.observe_target(9, 0.110)
    for _ in range(20):
        policy.observe_verify(0, 8, 2)
    # Measured: 16 nodes 4 tokens / 0.21 s = 19/s; 8 nodes 3 / 0.14 = 21/s; 4 nodes (untried:
    # optimistic 3 tokens at <= 0.11 + 0.03 s) still gets its try.
    assert policy.choose(tree_context(1)) == (4,)
    policy.observe_target(5, 0.105)
    for _ in range(20):
        policy.observe_verify(0, 4, 1)
    # 4 nodes: 2 / 0.135 = 14.8/s; the others are measured below 2 rows... 8 is best.
    policy.observe_target(3, 0.102)
    policy.observe_target(2, 0.101)
    for n in (1, 2):
        for _ in range(20):
            policy.observe_verify(0, n, 0.2)
    assert policy.choose(tree_context(1)) == (8,)


def test_trees_are_switched_off_where_they_cannot_pay_and_probed_later():
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0, probe_budget=1.0))
    policy.choose(tree_context(1))  # a tree context first, as the engine asks before drafting
    flat_then_linear(policy)
    for n in (1, 2, 4, 8, 16):
        policy.observe_propose(1, n, 0.150, unseen=0)  # drafting a tree costs 1.5 target steps
    for n in (1, 2, 4, 8, 16):
        for _ in range(10):
            policy.observe_verify(0, n, 0.5)
    choices = [policy.choose(tree_context(1))[0] for _ in range(policy.trees.probe_after + 1)]
    assert set(choices[:-1]) == {0}
    assert choices[-1] == 16  # a probe after probe_after steps off


def test_a_tree_probe_at_batch_four_drafts_for_one_request_only():
    """The request with the least to catch up on probes alone: a probe of every request (4 x 17
    verify rows, 4 catch-ups) costs several plain steps where trees do not pay."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0, probe_budget=1.0))
    policy.choose(tree_context(4))
    flat_then_linear(policy)
    for n in (1, 2, 4, 8, 16):
        policy.observe_propose(4, n, 0.150, unseen=0)
        for _ in range(10):
            policy.observe_verify(0, n, 0.5)
    ctx = SpeculationContext(seq_ids=(0, 1, 2, 3), params=(GREEDY,) * 4, caps=(16, 16, 0, 16),
                             unseen=(9, 5, 1, 7), max_k=16, kind=ProposalKind.TREE)  # fmt: skip
    choices = [policy.choose(ctx) for _ in range(policy.trees.probe_after + 1)]
    assert set(choices[:-1]) == {(0, 0, 0, 0)}
    assert choices[-1] == (0, 16, 0, 0)  # request 2 has no budget left


def test_a_tree_probe_waits_until_the_steps_off_pay_for_it():
    """A probe costs its extra verify rows, its drafting and its catch-up; it comes once the
    steps spent off, at ``probe_budget`` of their time, cover that (as the chain's probes):
    unbudgeted, one 16-node probe cost a batch-16 run about 1 % against plain."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    policy.choose(tree_context(1))
    flat_then_linear(policy)
    for n in (1, 2, 4, 8, 16):
        policy.observe_propose(1, n, 0.150, unseen=0)  # drafting a tree costs 1.5 target steps
        for _ in range(10):
            policy.observe_verify(0, n, 0.5)
    choices = [policy.choose(tree_context(1))[0] for _ in range(1000)]
    first = choices.index(16)
    plain = policy.target_cost.estimate(1)
    extra = policy.trees.step_seconds(policy.target_cost, 17, 16, 1) - plain
    assert first > policy.trees.probe_after and set(choices[:first]) == {0}
    assert first + 1 == math.ceil(extra / (0.01 * plain)), (first, extra, plain)


def test_a_policy_keeping_trees_on_re_measures_a_plain_step_now_and_then():
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    policy.choose(tree_context(1))
    flat_then_linear(policy, flat_rows=32)
    for n in (1, 2, 4, 8, 16):
        policy.observe_propose(1, n, 0.001, unseen=0)
        for _ in range(10):
            policy.observe_verify(0, n, 3.0)
    choices = [policy.choose(tree_context(1))[0] for _ in range(policy.trees.probe_after + 1)]
    assert set(choices[:-1]) == {16} and choices[-1] == 0


def test_large_batches_choose_smaller_trees_than_batch_one():
    """At batch 16 every tree node is a verify row the target pays for in full (linear part)."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    policy.choose(tree_context(1))
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        policy.observe_target(rows, 0.1 * max(1.0, rows / 20))  # flat to 20 rows, then linear
    for batch in (1, 2, 4, 8, 16):
        for n in (1, 2, 4, 8, 16):
            policy.observe_propose(batch, n, 0.010, unseen=0)
    for n, acc in ((1, 0.9), (2, 1.1), (4, 1.5), (8, 1.8), (16, 2.0)):
        for seq in range(16):
            for _ in range(10):
                policy.observe_verify(seq, n, acc)
    single = policy.choose(tree_context(1))[0]
    many = policy.choose(tree_context(16))[0]
    assert single == 16 and 0 < many < single, (single, many)


def test_tree_choices_leave_requests_without_budget_at_zero():
    policy = AdaptivePolicy()
    policy.observe_target(1, 0.1)
    ctx = SpeculationContext(
        seq_ids=(0, 1), params=(GREEDY,) * 2, caps=(5, 0), unseen=(0, 0), max_k=16,
        kind=ProposalKind.TREE,
    )
    assert policy.choose(ctx) == (16, 0)


CATCH_UP_S = 0.003  # a draft model's catch-up per unseen token: a 200-token prompt, 6 plain steps


def test_a_prompt_catch_up_is_not_taken_for_the_tree_drafting_cost():
    """Only the whole tree pays here (3 tokens in 0.13 s against a plain step's 1 in 0.1 s). Its
    first step also catches up on the prompt; counted as drafting, that 0.6 s would price the
    whole tree off, and once the smaller trees had been tried, every tree."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    policy.choose(tree_context(1))
    flat_then_linear(policy, flat_rows=32)  # the plain step and every verify pass: 0.1 s
    accepted = {1: 0, 2: 0, 4: 0, 8: 0, 16: 2}
    unseen, choices = 200, []
    for _ in range(8):
        n = policy.choose(tree_context(1, unseen=unseen))[0]
        choices.append(n)
        if n == 0:
            unseen += 1
            continue
        policy.observe_propose(1, n, 0.030 + CATCH_UP_S * unseen, unseen=unseen)
        policy.observe_verify(0, n, accepted[n])
        unseen = 0  # the proposer has seen the request's history now
    assert choices[0] == 16 and 0 not in choices and choices[-3:] == [16] * 3, choices
    assert policy.trees.draft_seconds(16, 1) == pytest.approx(0.030)


def tree_policy_with_catch_up() -> AdaptivePolicy:
    """Every tree size measured (0.03 s to draft, 2 tokens accepted), then a new request's
    first tree step: 0.6 s of catch-up on its 200-token prompt."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    policy.choose(tree_context(1))
    flat_then_linear(policy, flat_rows=32)
    for n in TreeSizer.sizes(16):
        policy.observe_propose(1, n, 0.030, unseen=0)
        policy.observe_verify(0, n, 2)
    policy.observe_propose(1, 16, 0.030 + CATCH_UP_S * 200, unseen=200)
    return policy


def test_a_tree_step_s_catch_up_is_measured_as_catch_up():
    policy = tree_policy_with_catch_up()
    assert policy.catchup_seconds(200) == pytest.approx(CATCH_UP_S * 200)
    assert policy.trees.draft_seconds(16, 1) == pytest.approx(0.030)  # drafting unchanged


def test_a_tree_step_with_unseen_tokens_and_no_drafting_measured_is_not_recorded():
    policy = AdaptivePolicy()
    policy.choose(tree_context(1))
    policy.observe_propose(1, 16, 0.600, unseen=200)
    assert not policy.trees.draft_costs and not policy.catchup_cost.measured


def test_tree_catch_up_is_paid_only_where_the_remaining_tokens_repay_it():
    policy = tree_policy_with_catch_up()
    # The engine's tree caps count nodes (max_k for every open request); ctx.remaining tells
    # how long a request has left. 0.6 s over the 5 / 3 steps left: more than the tree saves.
    assert policy.choose(tree_context(1, caps=16, unseen=200, remaining=5)) == (0,)
    assert policy.choose(tree_context(1, caps=16, unseen=200, remaining=500)) == (16,)
    assert policy.choose(tree_context(1, caps=16, unseen=0, remaining=5)) == (16,)
    # Without remaining, a policy can only assume caps + 1 tokens are left.
    assert policy.choose(tree_context(1, caps=4, unseen=200)) == (0,)


def test_a_tree_is_priced_by_the_tokens_its_request_has_left():
    """A request 2 tokens from its end emits at most 2, however long the trees' accepted paths
    are: priced at 1 + 3 tokens, a 4-node tree looked worth a 30-token catch-up (0.09 s on a
    0.1 s step) and every such step cost more than plain. Uncapped, the last choice flips."""
    policy = AdaptivePolicy(AdaptivePolicyConfig(cost_decay=0.0))
    policy.choose(tree_context(1))
    flat_then_linear(policy, flat_rows=32)
    for n in TreeSizer.sizes(16):
        policy.observe_propose(1, n, 0.030, unseen=0)
        policy.observe_verify(0, n, min(n, 3))
    policy.observe_propose(1, 16, 0.030 + CATCH_UP_S * 30, unseen=30)
    assert policy.choose(tree_context(1, caps=16, unseen=30, remaining=200)) == (16,)
    assert policy.choose(tree_context(1, caps=16, unseen=0, remaining=2)) == (16,)
    assert policy.choose(tree_context(1, caps=16, unseen=30, remaining=2)) == (0,)


# ----------------------------------------------------------------------------- cold-start luck


def run_steps(policy: AdaptivePolicy, accept, steps: int, draft_s: float = 0.05) -> list[int]:
    """Drive ``policy`` as the engine does for one request (convex target costs, a draft
    model of ``draft_s`` per token, catching up on the tokens it skipped at a fifth of that
    each): ``accept(step, k)`` -> drafts accepted. The chosen k per step."""
    ks, unseen = [], 1
    for step in range(steps):
        (k,) = policy.choose(context(1, unseen=unseen))
        if k:
            catch_up = draft_s / 5 * (unseen - 1)
            policy.observe_propose(1, k, draft_s * k + catch_up, unseen=unseen - 1)
            policy.observe_verify(0, k, accept(step, k))
            unseen = 1
        else:
            unseen += 1
        policy.observe_target(k + 1, convex(k + 1))
        ks.append(k)
    return ks


def measured_policy() -> AdaptivePolicy:
    policy = AdaptivePolicy()
    for rows in range(1, MAX_K + 2):
        policy.observe_target(rows, convex(rows))
    policy.observe_propose(1, 1, 0.05, unseen=0)
    return policy


def test_unlucky_rejections_do_not_switch_speculation_off():
    """Two rejections at the first draft position on the first two steps (a 2.5% chance at
    84% acceptance) once held a fresh generator at k = 0 for good: nothing at k = 0 is judged
    again. Evidence now ages with steps, so it drafts again, and then keeps drafting."""
    policy = measured_policy()
    ks = run_steps(policy, lambda step, k: 0 if step < 2 else k, 120)
    assert ks[0] > 0 and ks[1] > 0 and ks[2] == 0  # it drafted, was rejected twice, stopped
    back = next(i for i, k in enumerate(ks) if i > 2 and k > 0)
    assert back < 30 and min(ks[back + 10 :]) == MAX_K


def test_negative_control_evidence_that_never_ages_stays_plain(monkeypatch):
    monkeypatch.setattr("specdec.policy.adaptive._Counts.age", lambda self, decay: None)
    policy = measured_policy()
    ks = run_steps(policy, lambda step, k: 0 if step < 2 else k, 120)
    assert ks[2:] == [0] * 118


def first_rejected_at_two(step: int, k: int) -> int:
    return 1 if step == 0 else k  # the first step: position 2 rejected; then every draft kept


def test_one_rejection_at_position_two_does_not_cap_k():
    """A position judged too low is never drafted, so never judged again: a position's prior is
    at least the acceptance pooled over all positions, and a cold policy whose first step
    rejected position 2 reaches long drafts within a few steps."""
    policy = measured_policy()
    ks = run_steps(policy, first_rejected_at_two, 12)
    assert ks[0] >= 2 and max(ks[1:6]) == MAX_K


def test_negative_control_the_previous_position_alone_as_prior_caps_k(monkeypatch):
    def chained(self, n):  # each position's prior the one before it only (2026-12-05 morning)
        c, g = self.config, self._global
        out = []
        for j in range(n):
            prior = out[-1] if out else c.prior_acceptance
            out += position_hazards(g.accepted_at[j : j + 1], g.judged_at[j : j + 1], [prior], c.prior_weight)
        return out

    monkeypatch.setattr(AdaptivePolicy, "global_hazards", chained)
    policy = measured_policy()
    ks = run_steps(policy, first_rejected_at_two, 12)
    assert ks[0] >= 2 and max(ks[1:6]) < MAX_K


def test_a_large_batch_is_priced_by_the_chord_not_optimistically():
    """Batch 16, every row at its compute cost above 6 rows (``convex``), a prefill of 512
    rows and plain 16-row steps measured, drafts accepted 80%: a 64-row verify pass is priced
    by the chord (about 3x a plain step), so the policy stays plain instead of trying it."""
    policy = AdaptivePolicy()
    for rows in (512, *range(1, 8), 16):
        policy.observe_target(rows, convex(rows))
    policy.observe_propose(1, 1, 0.05, unseen=0)
    accepting(policy, 0, accepted=4, drafted=5, n=20)
    (*ks,) = policy.choose(context(16))
    assert ks == [0] * 16
    chord = policy.target_cost.estimate(64, optimistic=True)
    assert chord == pytest.approx(convex(64), rel=0.5) and chord > 2 * convex(16)


def test_negative_control_optimism_at_every_size_tries_the_64_row_pass(monkeypatch):
    monkeypatch.setattr(policy_module, "EXACT_SIZES", 10**9)  # every size "small": optimistic
    policy = AdaptivePolicy()
    for rows in (512, *range(1, 8), 16):
        policy.observe_target(rows, convex(rows))
    policy.observe_propose(1, 1, 0.05, unseen=0)
    accepting(policy, 0, accepted=4, drafted=5, n=20)
    assert sum(policy.choose(context(16))) > 0


def test_one_unlucky_first_tree_step_does_not_price_the_size_at_zero():
    """A new size starts from one fading pseudo-step at the prior: after one step that kept
    nothing it is priced between the two (zero would keep it off until a probe), and the prior
    is gone once real steps pile up."""
    sizer = TreeSizer(decay=0.9, cost_decay=0.8, prior_accepted=1.0)
    sizer.observe_verify(0, 16, 0)
    assert sizer.accepted(16) == pytest.approx(0.9 / 1.9)
    for _ in range(200):
        sizer.observe_verify(0, 16, 3)
    assert sizer.accepted(16) == pytest.approx(3.0, rel=1e-6)


def test_a_request_s_failing_small_trees_do_not_price_its_large_trees_off():
    """SuffixHybrid's small trees are suffix trees and its large ones the draft model's: a
    request whose suffix trees keep failing (fresh text) still drafts the model's trees, which
    the generator has measured to pay. One ratio per request over every size (the old rule)
    sank the large size's estimate with the small one's failures."""
    sizer = TreeSizer(decay=0.9, cost_decay=0.8, prior_accepted=1.0)
    for _ in range(20):
        sizer.observe_verify(0, 4, 3)  # another request: the model's trees keep 3 of 4
    for _ in range(20):
        sizer.observe_verify(1, 1, 0)  # this one: its one-node suffix trees keep nothing
    assert sizer.accepted(1, seq_id=1) < 0.2
    assert sizer.accepted(4, seq_id=1) == pytest.approx(sizer.accepted(4), rel=1e-6)


def test_a_size_s_first_step_does_not_move_the_request_s_ratio():
    """A size's first step was priced with the next size's length as a stand-in; missing it
    says nothing about the request."""
    sizer = TreeSizer(decay=0.9, cost_decay=0.8, prior_accepted=1.0)
    sizer.observe_verify(0, 4, 3)
    sizer.observe_verify(1, 2, 0)  # bucket 1's first step, expected 3 (bucket 2's stand-in)
    assert sizer.accepted(2, seq_id=1) == pytest.approx(sizer.accepted(2))
