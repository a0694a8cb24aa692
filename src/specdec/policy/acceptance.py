"""The acceptance model: how many tokens a verification step emits, and how often drafts are
accepted (pure functions of counts; no state).

A step with ``k`` drafts is a run of accepted drafts ended by one rejection or by running out of
drafts; with a per-position acceptance ``a`` it emits :func:`expected_emitted` tokens on average,
and :func:`acceptance_estimate` recovers ``a`` from what the steps accepted and rejected.

One ``a`` for every position under-prices long drafts: text mixes easy stretches (where every
draft is right) with hard ones, so a draft that follows accepted drafts is more likely right
than the first one (measured on the Qwen pair at k = 6: 0.84, 0.88, 0.89, 0.94, 0.97, 0.98 per
position, given the earlier ones accepted). The adaptive policy therefore keeps one
conditional acceptance per position (:func:`position_hazards`) and prices ``k`` drafts by their
running products (:func:`survival`): ``expected_emitted = 1 + sum_j survival_j``.

Example:
    >>> expected_emitted(acceptance_estimate(3.0, 1.0, prior=0.6, prior_weight=0.0), 1)
    1.75
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["acceptance_estimate", "expected_emitted", "position_hazards", "survival"]


def expected_emitted(a: float, k: int) -> float:
    """Expected tokens one verification step emits: ``(1 - a^(k+1)) / (1 - a)``.

    ``a`` is the per-position acceptance (each draft is accepted with probability ``a`` given
    that every earlier one was), ``k`` the number of drafts; the recovered or bonus token counts,
    so ``k = 0`` (a plain step) gives 1 and ``a -> 1`` gives ``k + 1``.

    Example:
        >>> expected_emitted(0.5, 2)
        1.75
    """
    # Checked inline rather than by config.py's validators: this runs in the policy's inner
    # loops, and a bad k (even a float or bool) has always been a ValueError here.
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"a must be in [0, 1], got {a!r}")
    # The sum form is the closed form without its 0/0 at a = 1.
    return math.fsum(a**j for j in range(k + 1))


def acceptance_estimate(
    accepted: float, rejections: float, prior: float, prior_weight: float
) -> float:
    """Per-position acceptance under the truncated-geometric model, with a prior.

    Each verification step is a run of accepted drafts ended by one rejection, or cut short by
    the number of drafts (then no rejection is seen). The maximum-likelihood acceptance is
    ``accepted / (accepted + rejections)``, where ``rejections`` counts the steps that rejected
    a draft. ``prior_weight`` pseudo-observations at ``prior`` keep new requests sane.

    Example:
        >>> acceptance_estimate(3.0, 1.0, prior=0.6, prior_weight=0.0)
        0.75
    """
    if accepted < 0 or rejections < 0 or prior_weight < 0:
        raise ValueError("accepted, rejections and prior_weight must be >= 0")
    if not 0.0 <= prior <= 1.0:
        raise ValueError(f"prior must be in [0, 1], got {prior!r}")
    total = accepted + rejections + prior_weight
    if total == 0:
        return prior
    return (accepted + prior_weight * prior) / total


def position_hazards(
    accepted: Sequence[float],
    judged: Sequence[float],
    priors: Sequence[float],
    prior_weight: float,
) -> list[float]:
    """Per draft position, the acceptance given that every earlier draft was accepted.

    ``judged[j]`` counts the steps that judged the draft at position ``j + 1`` (drafted it and
    accepted every earlier one), ``accepted[j]`` those that accepted it; ``priors[j]`` is the
    position's prior, worth ``prior_weight`` pseudo-observations. Positions past the counts
    give their prior. Returns ``len(priors)`` values in [0, 1].

    Example:
        >>> position_hazards([8.0, 3.0], [10.0, 4.0], [0.6, 0.6, 0.6], prior_weight=0.0)
        [0.8, 0.75, 0.6]
    """
    if prior_weight < 0:
        raise ValueError(f"prior_weight must be >= 0, got {prior_weight!r}")
    out = []
    for j, prior in enumerate(priors):
        acc = accepted[j] if j < len(accepted) else 0.0
        n = judged[j] if j < len(judged) else 0.0
        total = n + prior_weight
        out.append(prior if total <= 0 else min(1.0, max(0.0, (acc + prior_weight * prior) / total)))
    return out


def survival(hazards: Sequence[float]) -> list[float]:
    """``P(drafts 1..j all accepted)`` for ``j = 1..len(hazards)``: running products.

    ``1 + sum(survival(h)[:k])`` is the expected number of tokens a step with ``k`` drafts
    emits (for equal hazards ``a`` it is :func:`expected_emitted` ``(a, k)``).

    Example:
        >>> survival([0.5, 0.5, 1.0])
        [0.5, 0.25, 0.25]
    """
    out, p = [], 1.0
    for h in hazards:
        p *= h
        out.append(p)
    return out
