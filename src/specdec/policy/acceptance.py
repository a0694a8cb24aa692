"""The acceptance model: how many tokens a verification step emits, and how often drafts are
accepted (pure functions of counts; no state).

A step with ``k`` drafts is a run of accepted drafts ended by one rejection or by running out of
drafts; with a per-position acceptance ``a`` it emits :func:`expected_emitted` tokens on average,
and :func:`acceptance_estimate` recovers ``a`` from what the steps accepted and rejected.

Example:
    >>> expected_emitted(acceptance_estimate(3.0, 1.0, prior=0.6, prior_weight=0.0), 1)
    1.75
"""

from __future__ import annotations

import math

__all__ = ["acceptance_estimate", "expected_emitted"]


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
