"""Sizing draft trees from measured costs: how many tree nodes a step verifies (0 = off).

A tree proposer's k is a node count. Its proposal is best-first (parents before children,
higher-scoring nodes first), so the tree of ``n`` nodes is a subtree of the tree of ``m > n``
nodes and its accepted path is never longer: the expected accepted length ``A(n)`` does not
fall with ``n``, while the verify pass's rows ``n + 1`` (and on large batches its cost) grow. A
tree's drafting cost does not depend on ``n`` (the whole tree is grown, then trimmed); it is a
cost per step, by the number of drafting requests. A draft model's catch-up on tokens it has not
seen (a whole prompt on a request's first drafting step) is not part of it: the policy measures
it on its own curve and :meth:`TreeSizer.choose` adds each open request's catch-up, spread over
the steps the request has left, to the time of every tree size.

:class:`TreeSizer` learns ``A(n)`` per power-of-two bucket of ``n`` (decayed means, with each
request's own ratio to the generator-wide mean per bucket, shrunk toward 1: a proposer's small
and large trees may come from different sources, as SuffixHybrid's do) and the drafting cost, and
picks the size with the best expected tokens per second for the batch, the target pass priced
by the policy's :class:`~specdec.policy.cost_model.CostCurve` and the drafting by a cost curve
per size bucket (a tree of ``n`` nodes is grown only ``min(depth, n)`` deep). Cold start: an
unmeasured size is priced optimistically (the accepted length of the nearest measured size above
it, or a prior; the drafting cost of the nearest measured size below), so each is tried once
before measurements decide. Measurements of the road not taken go stale, so after
``probe_after`` steps with trees off the whole tree is tried once (by one request), and after
``probe_after`` steps with trees on one plain step re-measures the plain cost.

Example:
    >>> sizer = TreeSizer(decay=0.9, cost_decay=0.8)
    >>> sizer.sizes(16)
    [1, 2, 4, 8, 16]
"""

from __future__ import annotations

import math
from collections.abc import Callable

from specdec.interfaces import SpeculationContext
from specdec.policy.cost_model import CostCurve, Extrapolation

__all__ = ["TreeSizer"]


class TreeSizer:
    """The tree half of :class:`~specdec.policy.adaptive.AdaptivePolicy` (state by request id)."""

    def __init__(
        self, decay: float, cost_decay: float, prior_accepted: float = 1.0, probe_after: int = 64
    ) -> None:
        self.decay = decay
        self.prior_accepted = prior_accepted
        self.probe_after = probe_after
        self._curve = lambda: CostCurve(cost_decay, Extrapolation.FLAT)
        # Seconds of growing a tree, by batch, per power-of-two bucket of its node count (a tree
        # of n nodes is grown to depth min(depth, n) only).
        self.draft_costs: dict[int, CostCurve] = {}
        self._accepted: dict[int, list[float]] = {}  # bucket -> [decayed sum, decayed count]
        # (seq_id, bucket) -> [decayed accepted, decayed expected]
        self._ratio: dict[tuple[int, int], list[float]] = {}
        self._off_run = 0  # consecutive steps with trees off
        self._on_run = 0  # consecutive steps with trees on

    @staticmethod
    def sizes(max_k: int) -> list[int]:
        """Candidate node counts: powers of two below ``max_k``, and ``max_k``."""
        out = {max_k}
        n = 1
        while n < max_k:
            out.add(n)
            n *= 2
        return sorted(out)

    # ------------------------------------------------------------------ estimates
    def accepted(self, n: int, seq_id: int | None = None) -> float:
        """Expected accepted path length with ``n`` nodes (optimistic where unmeasured)."""
        if n <= 0:
            return 0.0
        bucket = int(math.log2(n))
        if bucket in self._accepted:
            total, count = self._accepted[bucket]
            value = total / count
        else:  # the nearest measured bucket above bounds it from above: try it
            above = [b for b in self._accepted if b > bucket]
            if above:
                total, count = self._accepted[min(above)]
                value = total / count
            else:
                below = [t / c for b, (t, c) in self._accepted.items() if b < bucket]
                value = max([self.prior_accepted, *below])
        return value * self._request_ratio(seq_id, bucket)

    def _request_ratio(self, seq_id: int | None, bucket: int) -> float:
        """The request's accepted / expected at this size bucket (one pseudo-step at the
        generator's rate). Per bucket, not per request: SuffixHybrid's small trees are suffix
        trees (free to draft, so they win where few nodes are allowed) and its large ones the
        draft model's; one ratio over both once let a fresh prompt's failing suffix trees price
        the draft model's trees off too."""
        if seq_id is None or (seq_id, bucket) not in self._ratio:
            return 1.0
        got, expected = self._ratio[seq_id, bucket]
        return (got + 1.0) / (expected + 1.0)

    def draft_seconds(self, n: int, drafting: int, target_cost: CostCurve | None = None) -> float:
        """Seconds of growing ``drafting`` trees of ``n`` nodes; unmeasured sizes cost what the
        nearest measured smaller size costs (a lower bound), 0 before any measurement. Past
        the largest measured batch the cost grows as ``target_cost`` does over as many rows
        (as :meth:`~specdec.policy.adaptive.AdaptivePolicy.draft_per_token` explains)."""
        if n <= 0 or drafting <= 0:
            return 0.0
        bucket = int(math.log2(n))
        below = [b for b in self.draft_costs if b <= bucket]
        if not below:
            return 0.0
        curve = self.draft_costs[max(below)]
        return curve.estimate(drafting) if target_cost is None else curve.estimate_like(drafting, target_cost)

    def draft_measured(self, n: int) -> bool:
        """Whether growing trees of ``n`` nodes has been timed (``n``'s own bucket)."""
        return n > 0 and int(math.log2(n)) in self.draft_costs

    def step_seconds(self, target_cost: CostCurve, rows: int, n: int, drafting: int) -> float:
        """Estimated seconds of a step: ``rows`` target rows, ``drafting`` trees of ``n`` nodes."""
        return target_cost.estimate(rows, optimistic=True) + self.draft_seconds(n, drafting, target_cost)

    # ------------------------------------------------------------------ choosing
    def choose(
        self,
        ctx: SpeculationContext,
        target_cost: CostCurve,
        catchup: Callable[[int], float],
    ) -> tuple[int, ...]:
        """One node count for every request that can keep a draft, the best rate's (0 = off).

        ``catchup(unseen)``: the estimated seconds of the proposer's catch-up on ``unseen``
        tokens (:meth:`~specdec.policy.adaptive.AdaptivePolicy.catchup_seconds`).
        """
        open_ = [c > 0 for c in ctx.caps]
        if ctx.max_k <= 0 or not any(open_) or not target_cost.measured:
            return (0,) * len(ctx.caps)
        batch = len(ctx.caps)
        drafting = sum(open_)
        # Once per request, not per size: the catch-up does not depend on the tree.
        catchups = [catchup(u) if o and u > 0 else 0.0 for u, o in zip(ctx.unseen, open_)]
        # A tree's caps count nodes (the engine sets every open one to max_k), so how long a
        # request has left to repay its catch-up comes from ctx.remaining.
        remaining = ctx.remaining or tuple(c + 1 for c in ctx.caps)
        best_n, best_rate = 0, batch / self.step_seconds(target_cost, batch, 0, 0)
        for n in reversed(self.sizes(ctx.max_k)):  # ties go to the larger tree: it measures more
            # A request emits at most what it has left: one 2 tokens from its end once priced a
            # 4-node tree at 1 + 3.5 tokens and paid a whole catch-up on its prompt for it.
            accepted = [
                min(self.accepted(n, s), left - 1.0) if o else 0.0
                for s, o, left in zip(ctx.seq_ids, open_, remaining)
            ]
            emitted = sum(1.0 + a for a in accepted)
            seconds = self.step_seconds(target_cost, batch + n * drafting, n, drafting) + sum(
                _spread(c, left, 1.0 + a) for c, left, a in zip(catchups, remaining, accepted)
            )
            rate = emitted / seconds if seconds > 0 else math.inf
            if rate > best_rate:
                best_n, best_rate = n, rate
        # Measurements of a choice not taken go stale (the first steps of a process are slow,
        # machines drift): after probe_after steps one way, one step the other way.
        if best_n == 0:
            self._off_run, self._on_run = self._off_run + 1, 0
            if self._off_run > self.probe_after:  # look again: the workload may have changed
                self._off_run = 0
                return self._probe(ctx, open_)
        else:
            self._on_run, self._off_run = self._on_run + 1, 0
            if self._on_run > self.probe_after:  # re-measure a plain step
                best_n, self._on_run = 0, 0
        return tuple(best_n if o else 0 for o in open_)

    @staticmethod
    def _probe(ctx: SpeculationContext, open_: list[bool]) -> tuple[int, ...]:
        """The whole tree for one open request, the one with the least to catch up on: a probe
        of every request at batch 16 verified 16 x 17 rows and caught the draft model up on
        every request's tokens (each such step cost several plain ones)."""
        first = min((r for r, o in enumerate(open_) if o), key=lambda r: ctx.unseen[r])
        return tuple(ctx.max_k if r == first else 0 for r in range(len(open_)))

    # ------------------------------------------------------------------ observing
    def observe_propose(self, batch: int, n: int, seconds: float) -> None:
        if n < 1:
            return
        self.draft_costs.setdefault(int(math.log2(n)), self._curve()).observe(batch, seconds)

    def observe_verify(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        expected = self.accepted(num_drafted)  # the generator-wide estimate, before this step
        bucket = int(math.log2(num_drafted))
        measured = bucket in self._accepted
        # A new bucket starts from one pseudo-step at the prior, which fades like any step: one
        # unlucky first step (nothing accepted) would otherwise price the size at zero and
        # keep it off until a probe.
        total, count = self._accepted.get(bucket, (self.prior_accepted, 1.0))
        self._accepted[bucket] = [self.decay * total + num_accepted, self.decay * count + 1.0]
        if not measured:
            # The size's first step: ``expected`` was the optimistic stand-in (the next size
            # up's length), not an estimate, and the request is not worse for missing it. A
            # proposer whose small trees come from another source than its large ones
            # (SuffixHybrid: suffix trees are cheap, so they win the small sizes) once sank
            # the request's ratio this way and priced every size, the good ones too, off.
            return
        got, exp = self._ratio.get((seq_id, bucket), (0.0, 0.0))
        self._ratio[seq_id, bucket] = [self.decay * got + num_accepted, self.decay * exp + expected]

    def release(self, seq_id: int) -> None:
        for key in [key for key in self._ratio if key[0] == seq_id]:
            del self._ratio[key]


def _spread(catchup_s: float, remaining: int, per_step: float) -> float:
    """Seconds per step of a catch-up of ``catchup_s`` spread over the steps (at least one) a
    request that may still emit ``remaining`` tokens has left at ``per_step`` emitted tokens a
    step: a request about to finish does not pay for a long catch-up (as in the chain policy)."""
    if catchup_s <= 0:
        return 0.0
    return catchup_s / max(1.0, remaining / per_step)
