"""Choosing k: how many tokens each request drafts in a decode step (0 = speculation off).

Speculation pays when verifying ``k + 1`` rows costs little more than decoding one, and the
draft is cheap and often right. Neither holds everywhere: at large batch sizes the target pass
is no longer memory-bound (rows cost nearly their full price), and some drafts keep getting
rejected. :class:`AdaptivePolicy` picks k per request and per step to maximise the expected
emitted tokens per second of the step, from three things it measures as it runs:

- the seconds of a step apart from drafting, as a function of its target rows
  (:class:`CostCurve` over every target pass: prefill, plain decode, verification);
- the seconds of drafting one token, as a function of the drafting batch size, and of a
  stateful proposer catching up on tokens it skipped (a draft model after steps at k = 0);
- each request's acceptance at each draft position given the earlier ones were accepted
  (:func:`position_hazards`, shrunk toward the generator's).

With acceptance ``a`` at every position and ``k`` drafts a step emits :func:`expected_emitted`
``(1 - a^(k+1)) / (1 - a)`` tokens on average (a draft is kept only if every earlier one was);
with one acceptance per position it emits ``1 + sum(survival(hazards)[:k])``. :class:`FixedPolicy`
always drafts the same k (the behaviour before the adaptive policy).

Modules: :mod:`~specdec.policy.acceptance` (the acceptance model, pure functions),
:mod:`~specdec.policy.cost_model` (cost curves), :mod:`~specdec.policy.fixed`,
:mod:`~specdec.policy.adaptive` and :mod:`~specdec.policy.tree` (tree sizes for the adaptive
policy); this package only re-exports them.

Example:
    >>> gen = Generator.from_pretrained(target, proposer=draft)                  # adaptive
    >>> gen = Generator.from_pretrained(target, proposer=draft, policy=FixedPolicy(4))
"""

from specdec.policy.acceptance import (
    acceptance_estimate,
    expected_emitted,
    position_hazards,
    survival,
)
from specdec.policy.adaptive import AdaptivePolicy, AdaptivePolicyConfig
from specdec.policy.cost_model import EXACT_SIZES, CostCurve, Extrapolation, cost_bucket
from specdec.policy.fixed import FixedPolicy
from specdec.policy.tree import TreeSizer

__all__ = [
    "AdaptivePolicy",
    "AdaptivePolicyConfig",
    "CostCurve",
    "cost_bucket",
    "EXACT_SIZES",
    "Extrapolation",
    "FixedPolicy",
    "TreeSizer",
    "acceptance_estimate",
    "expected_emitted",
    "position_hazards",
    "survival",
]
