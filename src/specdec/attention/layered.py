"""Plans of a pass whose layers attend differently (Gemma's interleaved sliding and global layers).

An :class:`~specdec.interfaces.AttentionSpec` with ``layer_windows`` describes several
attentions at once. Every backend plans it the same way (:func:`plan_layers`): one ordinary plan
per distinct window, wrapped in a :class:`LayeredPlan` that says which one each layer takes; a
spec without ``layer_windows`` plans as before, so models of one window see no change. The
model resolves its layer's plan with :func:`layer_plan` before calling ``backend.run``, whose
signature stays per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from specdec.interfaces import AttentionSpec

__all__ = ["LayeredPlan", "layer_plan", "plan_layers"]


@attrs.frozen(eq=False)
class LayeredPlan:
    """One pass's plans, one per distinct layer attention, and which one each layer takes.

    Example:
        >>> plan = LayeredPlan(plans=("sliding", "global"), layer_group=(0, 0, 1))
        >>> layer_plan(plan, 2), layer_plan("one plan", 2)
        ('global', 'one plan')
    """

    plans: tuple[object, ...]  # one backend plan per distinct window
    layer_group: tuple[int, ...]  # [num_layers] index into plans

    def layer(self, i: int) -> object:
        return self.plans[self.layer_group[i]]


def layer_plan(plan: object, i: int) -> object:
    """The plan layer ``i`` attends with: ``plan`` itself unless it is a :class:`LayeredPlan`."""
    return plan.layer(i) if isinstance(plan, LayeredPlan) else plan


def plan_layers(spec: AttentionSpec, plan_one: Callable[[AttentionSpec, int], object]) -> object:
    """``plan_one(spec, 0)`` for a spec of one attention; else a :class:`LayeredPlan` of
    ``plan_one(group_spec, group)`` for each distinct window (``group`` numbers them from 0,
    for backends that keep state per group)."""
    specs, groups = spec.layer_specs()
    if not groups:
        return plan_one(spec, 0)
    return LayeredPlan(plans=tuple(plan_one(s, g) for g, s in enumerate(specs)), layer_group=groups)
