"""Sizing draft trees from measured costs: how many tree nodes a step verifies (0 = off).

A tree proposer's k is a node count. Its proposal is best-first (parents before children,
higher-scoring nodes first), so the tree of ``n`` nodes is a subtree of the tree of ``m > n``
nodes and its accepted path is never longer: the expected accepted length ``A(n)`` does not
fall with ``n``, while the verify pass's rows ``n + 1`` (and on large batches its cost) grow. A
tree's drafting cost does not depend on ``n`` (the whole tree is grown, then trimmed); it is a
cost per step, by the number of drafting requests.

:class:`TreeSizer` learns ``A(n)`` per power-of-two bucket of ``n`` (decayed means, with each
request's own ratio to the generator-wide means, shrunk toward 1) and the drafting cost, and
picks the size with the best expected tokens per second for the batch, the target pass priced
by the policy's :class:`~specdec.policy.CostCurve`. Cold start: an unmeasured size is priced
optimistically (the accepted length of the nearest measured size above it, or a prior; drafting
cost 0 until measured), so each is tried once before measurements decide. A generator that
turned trees off probes the largest tree again after ``probe_after`` steps, so a change of
workload is noticed.

Example:
    >>> sizer = TreeSizer(decay=0.9, cost_decay=0.8)
    >>> sizer.sizes(16)
    [1, 2, 4, 8, 16]
"""

from __future__ import annotations

import math

from specdec.interfaces import SpeculationContext

__all__ = ["TreeSizer"]


class TreeSizer:
    """The tree half of :class:`~specdec.policy.AdaptivePolicy` (state keyed by request id)."""

    def __init__(
        self, decay: float, cost_decay: float, prior_accepted: float = 1.0, probe_after: int = 64
    ) -> None:
        from specdec.policy import CostCurve, Extrapolation

        self.decay = decay
        self.prior_accepted = prior_accepted
        self.probe_after = probe_after
        self.draft_cost = CostCurve(cost_decay, Extrapolation.FLAT)  # seconds per step, by batch
        self._accepted: dict[int, list[float]] = {}  # bucket -> [decayed sum, decayed count]
        self._ratio: dict[int, list[float]] = {}  # seq_id -> [decayed accepted, decayed expected]
        self._off_run = 0  # consecutive steps with trees off

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
        return value * self._request_ratio(seq_id)

    def _request_ratio(self, seq_id: int | None) -> float:
        if seq_id is None or seq_id not in self._ratio:
            return 1.0
        got, expected = self._ratio[seq_id]
        return (got + 1.0) / (expected + 1.0)  # one pseudo-step at the generator's rate

    def step_seconds(self, target_cost, rows: int, drafting: int) -> float:
        draft = self.draft_cost.estimate(drafting) if drafting > 0 else 0.0
        return target_cost.estimate(rows, optimistic=True) + draft

    # ------------------------------------------------------------------ choosing
    def choose(self, ctx: SpeculationContext, target_cost) -> tuple[int, ...]:
        """One node count for every request that can keep a draft, the best rate's (0 = off)."""
        open_ = [c > 0 for c in ctx.caps]
        if ctx.max_k <= 0 or not any(open_) or not target_cost.measured:
            return (0,) * len(ctx.caps)
        batch = len(ctx.caps)
        best_n, best_rate = 0, batch / self.step_seconds(target_cost, batch, 0)
        for n in reversed(self.sizes(ctx.max_k)):  # ties go to the larger tree: it measures more
            emitted = sum(
                1.0 + (self.accepted(n, s) if o else 0.0) for s, o in zip(ctx.seq_ids, open_)
            )
            drafting = sum(open_)
            seconds = self.step_seconds(target_cost, batch + n * drafting, drafting)
            rate = emitted / seconds if seconds > 0 else math.inf
            if rate > best_rate:
                best_n, best_rate = n, rate
        if best_n == 0:
            self._off_run += 1
            if self._off_run > self.probe_after:  # look again: the workload may have changed
                best_n, self._off_run = ctx.max_k, 0
        else:
            self._off_run = 0
        return tuple(best_n if o else 0 for o in open_)

    # ------------------------------------------------------------------ observing
    def observe_propose(self, batch: int, seconds: float) -> None:
        self.draft_cost.observe(batch, seconds)

    def observe_verify(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        expected = self.accepted(num_drafted)  # the generator-wide estimate, before this step
        bucket = int(math.log2(num_drafted))
        total, count = self._accepted.get(bucket, (0.0, 0.0))
        self._accepted[bucket] = [self.decay * total + num_accepted, self.decay * count + 1.0]
        got, exp = self._ratio.get(seq_id, (0.0, 0.0))
        self._ratio[seq_id] = [self.decay * got + num_accepted, self.decay * exp + expected]

    def release(self, seq_id: int) -> None:
        self._ratio.pop(seq_id, None)
