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
before measurements decide.

A proposer that forecasts (:class:`~specdec.interfaces.ForecastsDrafts`:
:class:`~specdec.proposers.SuffixHybrid`) says, for a lone request (batch 1: see
:meth:`TreeSizer.choose`) and each size, how many nodes it would
draft, how many it expects accepted and whether a model drafts them; the sizer then prices
each size by those (verify rows of the nodes drafted, the model's drafting time by its own node
count and the requests it drafts for, its catch-up only where it drafts, free lookups timed
apart) and its own ``A(n)`` goes unused. A generator-wide ``A(n)`` could not tell a retried
request's 16-node suffix tree from a fresh prompt's empty one, and priced 16 allowed nodes as
17 verify rows where the model drafted 4: on 12 code edits and 12 HumanEval prompts (Intel
Xeon, 2 threads) the controller took 26 target passes on a retry where 12 sufficed.

Measurements of the road not taken go stale, so after
``probe_after`` steps with trees off, once those steps pay for it at ``probe_budget`` of their
time, the whole tree is tried once (by one request), and after
``probe_after`` steps with trees on one plain step re-measures the plain cost. Starts are
staggered as in the chain policy: several requests whose catch-ups together cost more than a
plain step do not start at once; the one with the least to catch up on may, if that pays.

Example:
    >>> sizer = TreeSizer(decay=0.9, cost_decay=0.8)
    >>> sizer.sizes(16)
    [1, 2, 4, 8, 16]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from specdec.interfaces import SpeculationContext
from specdec.policy.cost_model import CostCurve, Extrapolation, held_back_starts

__all__ = ["TreeSizer"]


class TreeSizer:
    """The tree half of :class:`~specdec.policy.adaptive.AdaptivePolicy` (state by request id)."""

    def __init__(
        self,
        decay: float,
        cost_decay: float,
        prior_accepted: float = 1.0,
        probe_after: int = 64,
        probe_budget: float = 0.01,
    ) -> None:
        self.decay = decay
        self.prior_accepted = prior_accepted
        self.probe_after = probe_after
        self.probe_budget = probe_budget
        self._curve = lambda: CostCurve(cost_decay, Extrapolation.FLAT)
        # Seconds of growing a tree, by batch, per power-of-two bucket of its node count (a tree
        # of n nodes is grown to depth min(depth, n) only).
        self.draft_costs: dict[int, CostCurve] = {}
        self._accepted: dict[int, list[float]] = {}  # bucket -> [decayed sum, decayed count]
        # (seq_id, bucket) -> [decayed accepted, decayed expected]
        self._ratio: dict[tuple[int, int], list[float]] = {}
        # Seconds of a propose call where only lookups drafted (no model), by batch.
        self.lookup_cost: CostCurve | None = None
        # Seconds per node of a forecast plan's model drafting, by the requests it drafts for.
        self.model_node_cost = self._curve()
        self._planned: tuple[int, int, int] | None = None  # see ``planned``
        self.forecasting = False  # whether the last choice came from forecasts
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
        self._planned = None
        # Forecasts size a lone request's trees. At batch > 1 the batch shares one size, and a
        # run of four fresh HumanEval prompts (one a repeat) on a 1-thread Xeon lost 6 % to
        # plain on them: the repeat's 12-of-12 suffix steps cost 31-row passes, finished it
        # early and left three requests at batch 3 as slow per step as four; the step-by-step
        # rate cannot see that a closed batch ends with its slowest request.
        self.forecasting = ctx.forecast is not None and len(ctx.seq_ids) == 1
        if ctx.max_k <= 0 or not any(open_) or not target_cost.measured:
            return (0,) * len(ctx.caps)
        if self.forecasting:
            n = self._forecast_best(ctx, open_, target_cost, catchup)
            return self._settle(ctx, open_, n, target_cost, catchup)
        n = self._best(ctx, open_, target_cost, catchup)
        if n > 0:
            # Staggered starts, as in the chain policy; the size is chosen again without the
            # held-back requests (plain included). A batch-4 step once started the draft model
            # on four fresh prompts at once, a second of catch-ups, where drafting did not pay.
            starting = [r for r, o in enumerate(open_) if o and ctx.unseen[r] > 2]
            held = held_back_starts(starting, ctx.unseen, catchup, target_cost.estimate(len(open_)))
            if held:
                open_ = [o and r not in held for r, o in enumerate(open_)]
                n = self._best(ctx, open_, target_cost, catchup)
        return self._settle(ctx, open_, n, target_cost, catchup)

    def _best(
        self,
        ctx: SpeculationContext,
        open_: list[bool],
        target_cost: CostCurve,
        catchup: Callable[[int], float],
    ) -> int:
        """The size with the best rate for the ``open_`` requests from the sizer's own
        accepted lengths per size (0: plain)."""
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
            accepted = [  # and at most n: an unmeasured size borrows a larger one's length
                min(self.accepted(n, s), n, left - 1.0) if o else 0.0
                for s, o, left in zip(ctx.seq_ids, open_, remaining)
            ]
            emitted = sum(1.0 + a for a in accepted)
            seconds = self.step_seconds(target_cost, batch + n * drafting, n, drafting) + sum(
                _spread(c, left, 1.0 + a) for c, left, a in zip(catchups, remaining, accepted)
            )
            rate = emitted / seconds if seconds > 0 else math.inf
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def _settle(
        self,
        ctx: SpeculationContext,
        open_: list[bool],
        best_n: int,
        target_cost: CostCurve,
        catchup: Callable[[int], float],
    ) -> tuple[int, ...]:
        """The size chosen, for every open request, after the probes below."""
        # Measurements of a choice not taken go stale (the first steps of a process are slow,
        # machines drift): after probe_after steps one way, one step the other way.
        if best_n == 0:
            self._off_run, self._on_run = self._off_run + 1, 0
            if self._off_run > self.probe_after and self._probe_affordable(ctx, open_, target_cost, catchup):
                # Look again: the workload may have changed.
                self._off_run = 0
                self._planned = None  # not a forecast plan: its drafting time is not recorded
                return self._probe(ctx, open_)
        else:
            self._on_run, self._off_run = self._on_run + 1, 0
            if self._on_run > self.probe_after:  # re-measure a plain step
                best_n, self._on_run, self._planned = 0, 0, None
        return tuple(best_n if o else 0 for o in open_)

    def _forecast_best(
        self,
        ctx: SpeculationContext,
        open_: list[bool],
        target_cost: CostCurve,
        catchup: Callable[[int], float],
    ) -> int:
        """The size with the best rate from the proposer's own forecasts (:class:`~specdec.
        interfaces.ForecastsDrafts`): each request's nodes and expected accepted drafts at each
        size, the model's drafting time where it drafts (by the requests it drafts for and its
        own node count), and its catch-up on the requests it drafts for, spread as above. The
        chosen size's plan is kept: it tells :meth:`observe_forecast_propose` what the
        ``propose`` call that follows timed."""
        assert ctx.forecast is not None
        batch = len(ctx.caps)
        remaining = ctx.remaining or tuple(c + 1 for c in ctx.caps)
        best_n, best_rate = 0, batch / self.step_seconds(target_cost, batch, 0, 0)
        for n in reversed(self.sizes(ctx.max_k)):
            rows, emitted, seconds, plan = self._forecast_step(ctx, n, open_, remaining, catchup)
            seconds += target_cost.estimate(rows, optimistic=True)
            seconds += self.forecast_draft_seconds(plan[0], plan[1], sum(open_), target_cost)
            rate = emitted / seconds if seconds > 0 else math.inf
            if rate > best_rate:
                best_n, best_rate, self._planned = n, rate, plan
        return best_n

    @staticmethod
    def _forecast_step(
        ctx: SpeculationContext,
        n: int,
        open_: list[bool],
        remaining: Sequence[int],
        catchup: Callable[[int], float],
    ) -> tuple[int, float, float, tuple[int, int, int]]:
        """A step at ``n`` nodes by the forecasts: its target rows, expected emitted tokens,
        catch-up seconds, and plan (the model's nodes, the requests it drafts for, the tokens
        it catches up on)."""
        assert ctx.forecast is not None
        rows, emitted, seconds = len(open_), float(len(open_)), 0.0
        model_nodes = model_rows = model_catchup = 0
        for f, o, left, cap in zip(ctx.forecast(n), open_, remaining, ctx.caps):
            if not o:
                continue
            nodes = min(f.nodes, n, cap)
            accepted = max(0.0, min(f.accepted, nodes, left - 1.0))
            rows += nodes
            emitted += accepted
            if f.model and nodes > 0:
                model_nodes, model_rows = max(model_nodes, nodes), model_rows + 1
                model_catchup += f.catchup
                seconds += _spread(catchup(f.catchup), left, 1.0 + accepted)
        return rows, emitted, seconds, (model_nodes, model_rows, model_catchup)

    def forecast_draft_seconds(
        self, model_nodes: int, model_rows: int, batch: int, target_cost: CostCurve | None = None
    ) -> float:
        """Drafting seconds of a forecast plan: the model's for ``model_rows`` requests at
        ``model_nodes`` nodes (its measured seconds per node at that many requests, grown as
        the target's pass past the largest measured; one forward per chain node, so a size
        never drafted is priced from the others), else the lookups alone for ``batch``
        requests (0 unmeasured: tried once). (Keyed by node bucket instead, a 2-node chain at
        batch 4 was priced free, never timed, while 5-node chains at batch 1 were.)"""
        if model_rows > 0:
            if target_cost is None:
                return self.model_node_cost.estimate(model_rows) * model_nodes
            return self.model_node_cost.estimate_like(model_rows, target_cost) * model_nodes
        if self.lookup_cost is None or batch <= 0:
            return 0.0
        return self.lookup_cost.estimate(batch)

    def _probe_affordable(
        self,
        ctx: SpeculationContext,
        open_: list[bool],
        target_cost: CostCurve,
        catchup: Callable[[int], float],
    ) -> bool:
        """Whether the steps spent off pay for a probe at ``probe_budget`` of their time, as
        the chain policy's probes: its extra verify rows, its drafting and its request's
        catch-up. (Unbudgeted, one 16-node probe with a catch-up cost a batch-16 run on a
        1-thread Xeon about 1 % against plain.)"""
        if not any(open_):
            return False
        batch = len(open_)
        plain = target_cost.estimate(batch)
        first = min((r for r, o in enumerate(open_) if o), key=lambda r: ctx.unseen[r])
        extra = (
            self.step_seconds(target_cost, batch + ctx.max_k, ctx.max_k, 1)
            - plain
            + catchup(ctx.unseen[first])
        )
        return self._off_run * self.probe_budget * plain >= extra

    @staticmethod
    def _probe(ctx: SpeculationContext, open_: list[bool]) -> tuple[int, ...]:
        """The whole tree for one open request, the one with the least to catch up on: a probe
        of every request at batch 16 verified 16 x 17 rows and caught the draft model up on
        every request's tokens (each such step cost several plain ones)."""
        first = min((r for r, o in enumerate(open_) if o), key=lambda r: ctx.unseen[r])
        return tuple(ctx.max_k if r == first else 0 for r in range(len(open_)))

    # ------------------------------------------------------------------ observing
    @property
    def planned(self) -> tuple[int, int, int] | None:
        """The forecast plan of the size last chosen (``None``: chosen without forecasts):
        the model's nodes, the requests it drafts for, the tokens it catches up on."""
        return self._planned

    def observe_propose(self, batch: int, n: int, seconds: float) -> None:
        if n < 1:
            return
        self.draft_costs.setdefault(int(math.log2(n)), self._curve()).observe(batch, seconds)

    def observe_forecast_propose(self, batch: int, seconds: float, drafting_seconds: float | None) -> None:
        """The ``propose`` call of a forecast plan (:attr:`planned`) took ``seconds`` for
        ``batch`` requests; ``drafting_seconds`` is that time less the model's catch-up
        (``None``: the split is unknown, nothing recorded). A call where no model drafted
        times the lookups; otherwise the model's drafting per node, by the requests it drafted
        for."""
        assert self._planned is not None
        model_nodes, model_rows, _ = self._planned
        if model_rows == 0:
            if self.lookup_cost is None:
                self.lookup_cost = self._curve()
            self.lookup_cost.observe(batch, seconds)
        elif drafting_seconds is not None and model_nodes > 0:
            self.model_node_cost.observe(model_rows, drafting_seconds / model_nodes)

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
