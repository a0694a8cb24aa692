"""The adaptive policy: per request and per step, the k with the best expected emitted tokens
per second, from measured step costs (:mod:`specdec.policy.cost_model`), each request's measured
acceptance per draft position (:mod:`specdec.policy.acceptance`) and, for tree proposers, a tree size
(:mod:`specdec.policy.tree`).

Example:
    >>> policy = AdaptivePolicy(AdaptivePolicyConfig(decay=0.8))
    >>> policy.acceptance(seq_id=0)  # a new request starts at the prior
    0.6
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from specdec.config import (
    positive_float,
    positive_int,
    unit_interval_closed,
    unit_interval_closed_open,
)
from specdec.interfaces import SpeculationContext
from specdec.policy.acceptance import acceptance_estimate, position_hazards, survival
from specdec.policy.cost_model import CostCurve, Extrapolation, held_back_starts
from specdec.policy.tree import TreeSizer
from specdec.types import ProposalKind

__all__ = ["AdaptivePolicy", "AdaptivePolicyConfig"]


@attrs.frozen(kw_only=True)
class AdaptivePolicyConfig:
    """Knobs of :class:`AdaptivePolicy`; the defaults need no tuning.

    - ``decay``: weight of a request's past acceptance per new verification step (recent steps
      count more); ``global_decay`` the same for the generator-wide acceptance.
    - ``prior_acceptance``, ``prior_weight``: a request's acceptance starts at the
      generator-wide estimate, which starts at ``prior_acceptance``; both carry
      ``prior_weight`` pseudo-observations.
    - ``cost_decay``: weight of the past in each cost curve point per new measurement.
    - ``probe_budget``: the share of throughput that probing requests whose drafts were
      switched off may cost; ``min_probe_interval``: steps at k = 0 before a request may be
      probed at all.
    """

    decay: float = attrs.field(default=0.9, validator=unit_interval_closed_open)
    global_decay: float = attrs.field(default=0.99, validator=unit_interval_closed_open)
    prior_acceptance: float = attrs.field(default=0.6, validator=unit_interval_closed)
    prior_weight: float = attrs.field(default=5.0, validator=positive_float)
    cost_decay: float = attrs.field(default=0.8, validator=unit_interval_closed_open)
    probe_budget: float = attrs.field(default=0.01, validator=positive_float)
    min_probe_interval: int = attrs.field(default=8, validator=positive_int)


@attrs.define
class _Counts:
    """Decayed acceptance counts of one request (or of the whole generator)."""

    accepted: float = 0.0
    rejections: float = 0.0
    zero_run: int = 0  # consecutive decode steps at k = 0
    # Per draft position j (index j - 1): steps that judged it (drafted it and accepted every
    # earlier draft) and steps that accepted it, decayed like the totals.
    judged_at: list[float] = attrs.field(factory=list)
    accepted_at: list[float] = attrs.field(factory=list)

    def age(self, decay: float) -> None:
        """One step passed: every count loses weight, judged this step or not (evidence that
        is never renewed, as of a request at k = 0, fades back to the prior)."""
        self.accepted *= decay
        self.rejections *= decay
        self.judged_at = [decay * x for x in self.judged_at]
        self.accepted_at = [decay * x for x in self.accepted_at]

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        self.rejections += 1.0 if num_accepted < num_drafted else 0.0
        judged = min(num_drafted, num_accepted + 1)
        grow = judged - len(self.judged_at)
        if grow > 0:
            self.judged_at.extend([0.0] * grow)
            self.accepted_at.extend([0.0] * grow)
        for j in range(judged):
            self.judged_at[j] += 1.0
            self.accepted_at[j] += j < num_accepted

    def pooled(self, prior: float, prior_weight: float) -> float:
        """Acceptance over every judged position together, with ``prior_weight``
        pseudo-observations at ``prior``."""
        return (math.fsum(self.accepted_at) + prior_weight * prior) / (
            math.fsum(self.judged_at) + prior_weight
        )


class AdaptivePolicy:
    """Per request and per step, the k that maximises the expected emitted tokens per second.

    For a plan ``k_r`` over the batch the step emits ``sum_r (1 + sum_{j <= k_r} s_r(j))``
    tokens in ``T(sum_r (k_r + 1)) + D(n) * max_r k_r + sum_{k_r > 0} c_r e_r`` seconds, where
    ``T`` is the measured cost of a step's target work by its rows, ``D(n)`` the measured
    seconds per drafted token when ``n`` requests draft (only requests with ``k_r > 0`` are
    sent to the proposer), ``s_r(j)`` the estimated chance that the request's first ``j``
    drafts are all accepted (:meth:`survival`: per-position acceptances, each request's shrunk
    toward the generator's), ``e_r`` the
    tokens the step emits for the request and ``c_r`` the proposer's catch-up on the request's
    unseen tokens (:meth:`catchup_seconds`; zero for a request that drafted last step) spread
    over the tokens the request has left. For each drafting
    width ``W`` the marginal gains ``s_r(j)`` (``j <= W``) are taken in decreasing order and the
    prefix with the best rate is kept; each such plan is polished by single +-1 changes, and
    the best plan wins. All zeros (a plain step) wins unless something beats it.

    Cold start: target passes of a row count whose bucket has not been measured are priced
    optimistically (:meth:`CostCurve.estimate` with ``optimistic=True``), so a fresh policy
    tries speculating as soon as a plain decode step (not a prefill) has been measured, and each row-count bucket is
    tried at most once before real costs decide. The proposer's cost is unknown until it first
    drafts; at batch size > 1 that first drafting step drafts for one request only. At a
    batch it has not drafted for, the proposer's cost grows as the target's pass does over as
    many rows (:meth:`draft_per_token`). Starts are staggered: when several requests would
    start drafting in one step and their catch-ups together cost more than a plain step, only
    the one with the least to catch up on may start, and only if the plan without the others
    still beats a plain step (:meth:`_stagger_starts`).

    Probing: a request at k = 0 is never measured again, so once it has spent enough steps at
    k = 0 that one probe step (k = 1, including what the proposer must catch up on) costs at
    most ``probe_budget`` of that time, and only if it would draft were its acceptance as good
    as the generator's, it drafts one token.

    Trees: for a tree proposer (``ctx.kind`` TREE) k counts tree nodes and the choice is one
    tree size for the step, from the measured accepted length per size and drafting cost per
    step (:class:`~specdec.policy.tree.TreeSizer`), plus each open request's catch-up spread
    over the steps it has left, as above; a proposer that forecasts per request what each
    size drafts (:class:`~specdec.interfaces.ForecastsDrafts`) is sized by its forecasts
    instead when one request runs. Catch-up is priced and measured apart from drafting:
    a ``propose`` call with unseen tokens feeds the catch-up curve, never a tree's drafting cost
    (one prompt's catch-up taken for drafting once made trees look several plain steps dear and
    switched them off). The first tree context switches the policy's observations of drafting
    and verification to the tree model.

    Costs come from wall-clock timings, so choices vary from run to run; greedy output never
    does. One instance belongs to one generator (state is keyed by request id).
    """

    def __init__(self, config: AdaptivePolicyConfig | None = None) -> None:
        if config is None:
            config = AdaptivePolicyConfig()
        if not isinstance(config, AdaptivePolicyConfig):
            raise TypeError(f"config must be an AdaptivePolicyConfig, got {type(config).__name__}")
        self.config = config
        self.target_cost = CostCurve(config.cost_decay, Extrapolation.PROPORTIONAL)
        self.draft_cost = CostCurve(config.cost_decay, Extrapolation.FLAT)
        self.catchup_cost = CostCurve(config.cost_decay, Extrapolation.PROPORTIONAL)
        self._global = _Counts()
        self._requests: dict[int, _Counts] = {}
        # Tree proposers (k = node count) are sized by their own model; the target's cost
        # curve is shared. Set by the first tree context: a policy serves one generator.
        self.trees = TreeSizer(config.decay, config.cost_decay, probe_budget=config.probe_budget)
        self._trees = False

    def __repr__(self) -> str:
        return f"AdaptivePolicy({self.config!r})"

    # ------------------------------------------------------------------ estimates
    def acceptance(self, seq_id: int) -> float:
        """The request's acceptance estimate under one acceptance for every position (the
        generator-wide one for a new request); the plans use :meth:`survival`."""
        w = self.config.prior_weight
        base = self.global_acceptance()
        counts = self._requests.get(seq_id)
        if counts is None:
            return base
        return acceptance_estimate(counts.accepted, counts.rejections, base, w)

    def global_acceptance(self) -> float:
        g = self._global
        c = self.config
        return acceptance_estimate(g.accepted, g.rejections, c.prior_acceptance, c.prior_weight)

    def global_hazards(self, n: int) -> list[float]:
        """The generator's acceptance at draft positions ``1..n`` given the earlier drafts were
        accepted. A position's prior is the better of the one before it and the acceptance
        pooled over all positions (the first's: the pooled one, itself shrunk toward
        ``prior_acceptance``): a position seldom drafted is assumed as good as those measured.
        Optimism there is what keeps the estimate honest: a position judged too low is never
        drafted, so never judged again (one early rejection at position 2 held a cold policy at
        k = 1 for a dozen steps where k = 4 was best)."""
        c, g = self.config, self._global
        pooled = g.pooled(c.prior_acceptance, c.prior_weight)
        out: list[float] = []
        for j in range(n):
            prior = max(out[-1], pooled) if out else pooled
            out.extend(position_hazards(g.accepted_at[j : j + 1], g.judged_at[j : j + 1],
                                        [prior], c.prior_weight))  # fmt: skip
        return out

    def survival(self, seq_id: int, n: int) -> list[float]:
        """Estimated chances that the request's drafts ``1..j`` are all accepted, ``j = 1..n``.

        Each position's acceptance given the earlier ones is the request's own decayed counts
        with ``prior_weight`` pseudo-observations at the generator's value for that position
        (:meth:`global_hazards`); a new request gets the generator's.
        """
        return self._survival(seq_id, self.global_hazards(n))

    def _survival(self, seq_id: int, base: Sequence[float]) -> list[float]:
        """:meth:`survival` given the generator's hazards ``base`` (one per position)."""
        counts = self._requests.get(seq_id)
        if counts is None:
            return survival(base)
        w = self.config.prior_weight
        return survival(position_hazards(counts.accepted_at, counts.judged_at, base, w))

    def expected_emitted(self, seq_id: int, k: int) -> float:
        """Expected tokens a step with ``k`` drafts emits for the request."""
        return _emitted(self.survival(seq_id, k), k)

    def step_seconds(self, rows: int, drafting: int, width: int) -> float:
        """Estimated seconds of a step: ``rows`` target rows, ``drafting`` requests drafting
        ``width`` tokens."""
        draft = self.draft_per_token(drafting) * width if width > 0 else 0.0
        return self.target_cost.estimate(rows, optimistic=True) + draft

    def draft_per_token(self, drafting: int) -> float:
        """Seconds per drafted token when ``drafting`` requests draft (0 before a measurement).

        Past the largest measured count the draft is assumed to grow as the target's pass does
        over as many rows, not to stay flat: on a 1-thread CPU a 0.5B draft over 3 rows took
        2.4x its 1-row step, and priced flat from the warm-up's 1-row step, a cold batch-4 step
        started all four requests drafting, four catch-ups at once, where drafting did not pay
        (0.90x plain). Where the target's pass is flat in its rows (a GPU) this is flat too.
        """
        return self.draft_cost.estimate_like(drafting, self.target_cost)

    def catchup_seconds(self, unseen: int) -> float:
        """Estimated extra drafting time for ``unseen`` tokens the proposer has not seen.

        A stateful proposer (a draft model) runs them through its first forward. Measured from
        ``propose`` calls that had tokens to catch up on; before the first, that forward is
        assumed to cost like the target's over the same rows, scaled by the measured ratio of
        one drafted token to one target row. (Tree proposers never feed that chain ratio, so
        for them an unmeasured catch-up is free: optimistic, tried once, then measured.)
        """
        if unseen <= 0:
            return 0.0
        if self.catchup_cost.measured:
            return self.catchup_cost.estimate(unseen)
        t1 = self.target_cost.estimate(1)
        if t1 <= 0:
            return 0.0
        ratio = self.draft_cost.estimate(1) / t1
        return ratio * max(0.0, self.target_cost.estimate(unseen + 1) - t1)

    # ------------------------------------------------------------------ choosing
    def choose(self, ctx: SpeculationContext) -> tuple[int, ...]:
        if ctx.kind is ProposalKind.TREE:
            self._trees = True
            return self.trees.choose(ctx, self.target_cost, self.catchup_seconds)
        caps = [min(c, ctx.max_k) for c in ctx.caps]
        # Evidence ages with steps, not with observations alone: a request at k = 0 (and a
        # generator where none drafts) drifts back toward the prior and drafts again, instead
        # of staying plain for good after a few unlucky rejections.
        self._global.age(self.config.global_decay)
        for seq_id in ctx.seq_ids:
            self._requests.setdefault(seq_id, _Counts()).age(self.config.decay)
        if not self.target_cost.measured_up_to(len(caps)):
            # No step of this batch's plain size or smaller measured yet (a prefill alone would
            # price one row at its share of the prompt's pass, a fraction of what it costs, and
            # plain steps would look several times cheaper than they are): a plain step
            # measures one.
            ks = [0] * len(caps)
        else:
            if not self.draft_cost.measured and len(caps) > 1:
                # The first drafting step prices the proposer (and its catch-up on a whole
                # prompt): one request, the one with the least to catch up on, pays for it.
                first = min(range(len(caps)), key=lambda r: ctx.unseen[r])
                caps = [c if r == first else 0 for r, c in enumerate(caps)]
            base = self.global_hazards(ctx.max_k)
            surv = [
                self._survival(s, base[: min(ctx.max_k, c)]) for s, c in zip(ctx.seq_ids, ctx.caps)
            ]
            switch = [self._catchup_per_token(ctx, r) for r in range(len(caps))]
            ks = self._plan(surv, caps, switch)
            held = self._stagger_starts(ctx, ks)
            if held:
                # Planned again without them: what is left must pay on its own (one request
                # drafting alone pays the draft's whole forward, which several share).
                caps = [0 if r in held else c for r, c in enumerate(caps)]
                ks = self._plan(surv, caps, switch)
            self._add_probes(ctx, surv, caps, ks, switch)
        for seq_id, k in zip(ctx.seq_ids, ks):
            counts = self._requests[seq_id]
            counts.zero_run = counts.zero_run + 1 if k == 0 else 0
        return tuple(ks)

    def _stagger_starts(self, ctx: SpeculationContext, ks: Sequence[int]) -> set[int]:
        """The requests the plan ``ks`` starts that must wait (:func:`~specdec.policy.
        cost_model.held_back_starts`)."""
        # A request that drafted last step has 1 or 2 unseen tokens (the newest, and the last
        # draft after a full acceptance), which every drafting step runs anyway: no catch-up.
        starting = [r for r, k in enumerate(ks) if k > 0 and ctx.unseen[r] > 2]
        plain = self.target_cost.estimate(len(ks))
        return held_back_starts(starting, ctx.unseen, self.catchup_seconds, plain)

    def _catchup_per_token(self, ctx: SpeculationContext, r: int) -> float:
        """Seconds per emitted token that drafting for request ``r`` costs on top of its drafts:
        the proposer's catch-up on its unseen tokens, paid once, spread over the tokens the
        request has left (a request about to finish does not pay for a long catch-up). A step
        that emits ``e`` tokens for the request carries ``e`` times this: at any k the catch-up
        costs the same per token. (Spread per step at the widest k instead, it priced a k = 1
        step ~3x too dear: a q4 pair at two threads, where only k = 1 pays, stayed plain for
        every request after the first.)"""
        if ctx.unseen[r] <= 0:
            return 0.0
        return self.catchup_seconds(ctx.unseen[r]) / (ctx.caps[r] + 1)

    def _rate(
        self, emitted: float, rows: int, drafting: int, width: int, extra: float = 0.0
    ) -> float:
        seconds = self.step_seconds(rows, drafting, width) + extra
        return emitted / seconds if seconds > 0 else math.inf

    def _plan(
        self, surv: Sequence[Sequence[float]], caps: Sequence[int], switch: Sequence[float]
    ) -> list[int]:
        """For each width, the best prefix of the marginal gains; each refined; the best wins."""
        batch = len(surv)
        plans = [[0] * batch]
        for width in range(1, max(caps, default=0) + 1):
            gains = _gains(surv, caps, width)
            emitted, rows, drafting, extra, taken = float(batch), batch, 0, 0.0, [0] * batch
            best_rate, best_m = 0.0, 0
            for m, (gain, r) in enumerate(gains, start=1):
                emitted += gain
                rows += 1
                if taken[r] == 0:
                    drafting += 1
                    extra += switch[r]  # the request's base token now carries its catch-up
                extra += switch[r] * gain
                taken[r] += 1
                rate = self._rate(emitted, rows, drafting, width, extra)
                if rate > best_rate:
                    best_rate, best_m = rate, m
            ks = [0] * batch
            for _, r in gains[:best_m]:
                ks[r] += 1
            plans.append(ks)
        refined = [self._refine(surv, caps, switch, ks) for ks in plans]
        return max(refined, key=lambda ks: self._plan_rate(surv, switch, ks))

    def _plan_rate(
        self, surv: Sequence[Sequence[float]], switch: Sequence[float], ks: Sequence[int]
    ) -> float:
        emitted = sum(_emitted(s, k) for s, k in zip(surv, ks))
        extra = _catchup(surv, switch, ks)
        return self._rate(emitted, sum(k + 1 for k in ks), sum(k > 0 for k in ks), max(ks), extra)

    def _refine(
        self,
        surv: Sequence[Sequence[float]],
        caps: Sequence[int],
        switch: Sequence[float],
        ks: list[int],
    ) -> list[int]:
        """Hill-climb from ``ks`` by single +-1 changes while the estimated rate improves.

        The prefix search above ignores that a request's first draft also makes one more
        request draft (``D(n)`` grows with ``n``) and may cost a catch-up; a few moves repair
        that.
        """
        emitted = sum(_emitted(s, k) for s, k in zip(surv, ks))
        rows = sum(k + 1 for k in ks)
        drafting = sum(k > 0 for k in ks)
        extra = _catchup(surv, switch, ks)
        counts = [0] * (max(caps, default=0) + 2)  # requests per k
        for k in ks:
            counts[k] += 1
        width = max(ks, default=0)
        rate = self._rate(emitted, rows, drafting, width, extra)
        for _ in range(len(ks) * (len(counts) + 1)):  # each move raises the rate; a bound anyway
            move = None
            for r, k in enumerate(ks):
                if k < caps[r]:
                    new = self._rate(
                        emitted + surv[r][k],
                        rows + 1,
                        drafting + (k == 0),
                        max(width, k + 1),
                        extra + switch[r] * (surv[r][k] + (k == 0)),
                    )
                    if new > rate:
                        rate, move = new, (r, 1)
                if k > 0:
                    new = self._rate(
                        emitted - surv[r][k - 1],
                        rows - 1,
                        drafting - (k == 1),
                        width - 1 if k == width and counts[k] == 1 else width,
                        extra - switch[r] * (surv[r][k - 1] + (k == 1)),
                    )
                    if new > rate:
                        rate, move = new, (r, -1)
            if move is None:
                break
            r, step = move
            k = ks[r]
            counts[k] -= 1
            emitted += surv[r][k] if step > 0 else -surv[r][k - 1]
            if step > 0:
                extra += switch[r] * (surv[r][k] + (k == 0))
            else:
                extra -= switch[r] * (surv[r][k - 1] + (k == 1))
            if step > 0 and k == 0:
                drafting += 1
            elif step < 0 and k == 1:
                drafting -= 1
            ks[r] = k + step
            counts[k + step] += 1
            rows += step
            width = max(j for j, c in enumerate(counts) if c)
        return ks

    def _add_probes(
        self,
        ctx: SpeculationContext,
        surv: Sequence[Sequence[float]],
        caps: Sequence[int],
        ks: list[int],
        switch: Sequence[float],
    ) -> None:
        c = self.config
        batch = len(ks)
        # As good as the generator's drafts, and at least the prior's.
        optimistic = [
            max(g, c.prior_acceptance ** (j + 1))
            for j, g in enumerate(survival(self.global_hazards(max(caps, default=0))))
        ]
        for r, seq_id in enumerate(ctx.seq_ids):
            zero_run = self._requests[seq_id].zero_run + 1  # counting this step
            if ks[r] > 0 or caps[r] == 0 or zero_run < c.min_probe_interval:
                continue
            rows = sum(k + 1 for k in ks)
            drafting = sum(k > 0 for k in ks)
            width = max(ks)
            emitted = sum(_emitted(s, k) for s, k in zip(surv, ks))
            extra = _catchup(surv, switch, ks)
            now = self.step_seconds(rows, drafting, width) + extra
            rate = emitted / now if now > 0 else math.inf
            # Worth knowing only if a good acceptance would make this request draft.
            if not any(
                self._rate(
                    emitted - 1 + _emitted(optimistic, j),
                    rows + j,
                    drafting + 1,
                    max(width, j),
                    extra + switch[r] * _emitted(optimistic, j),
                )
                > rate
                for j in range(1, caps[r] + 1)
            ):
                continue
            # What the probe step loses against the plan: its extra time (one more verify row,
            # the draft token, the catch-up) less the time the plan would take to emit the
            # s_r(1) tokens the probe is expected to add.
            cost = (
                self.step_seconds(rows + 1, drafting + 1, max(width, 1))
                + extra
                - now
                + self.catchup_seconds(ctx.unseen[r])
                - surv[r][0] * now / emitted
            )
            # This request's share of the time spent since it last drafted, times the budget.
            if zero_run * c.probe_budget * now / batch >= cost:
                ks[r] = 1

    # ------------------------------------------------------------------ observing
    def observe_target(self, rows: int, seconds: float) -> None:
        self.target_cost.observe(rows, seconds)

    def observe_propose(self, batch: int, width: int, seconds: float, unseen: int) -> None:
        if batch < 1 or width < 1:
            return
        if self._trees:
            self._observe_tree_propose(batch, width, seconds, unseen)
            return
        if unseen <= 0:
            self.draft_cost.observe(batch, seconds / width)
            return
        # The call also caught up on unseen tokens: split its time into drafting and catch-up.
        if self.draft_cost.measured:
            per_token = self.draft_per_token(batch)
        else:
            # No clean measurement yet: assume draft forwards cost like the target's over the
            # same rows, scaled. The first forward ran unseen + batch rows, the other
            # width - 1 ran batch rows each: seconds = ratio * (T(unseen + batch) +
            # (width - 1) * T(batch)); one drafted token costs ratio * T(batch).
            tb = self.target_cost.estimate(batch)
            work = self.target_cost.estimate(unseen + batch) + (width - 1) * tb
            per_token = seconds * tb / work if work > 0 else seconds / width
            self.draft_cost.observe(batch, per_token)
        self.catchup_cost.observe(unseen, max(0.0, seconds - width * per_token))

    def _observe_tree_propose(self, batch: int, n: int, seconds: float, unseen: int) -> None:
        if self.trees.forecasting:
            self._observe_forecast_propose(batch, seconds, unseen)
            if unseen <= 0:  # and as drafting by the size asked, for the sizer at batch > 1
                self.trees.observe_propose(batch, n, seconds)
            return
        if unseen <= 0:
            self.trees.observe_propose(batch, n, seconds)
        elif self.trees.draft_measured(n):
            drafting = self.trees.draft_seconds(n, batch, self.target_cost)
            self.catchup_cost.observe(unseen, max(0.0, seconds - drafting))
        # Else the split is unknown and the call is not recorded at all: taken as drafting
        # cost, the catch-up would price the size too dear to be tried again before a probe
        # (the chain path's guess, a ratio of the target's cost, has no tree counterpart). The
        # next step of a request that drafted has nothing unseen and times drafting alone.

    def _observe_forecast_propose(self, batch: int, seconds: float, unseen: int) -> None:
        """A ``propose`` call of the sizer's forecast plan: the model's drafting, or the
        lookups alone, timed; a call that caught up times the catch-up instead (split off
        the model's measured drafting time, as above)."""
        plan = self.trees.planned
        if plan is None:
            return  # a probe: no plan says who drafted
        if unseen <= 0:
            self.trees.observe_forecast_propose(batch, seconds, seconds)
            return
        nodes, rows, _ = plan
        if rows > 0 and self.trees.model_node_cost.measured:
            drafting = self.trees.forecast_draft_seconds(nodes, rows, batch, self.target_cost)
            self.catchup_cost.observe(unseen, max(0.0, seconds - drafting))

    def observe_verify(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return  # nothing was judged
        if self._trees:
            self.trees.observe_verify(seq_id, num_drafted, num_accepted)
            return
        self._requests.setdefault(seq_id, _Counts()).add(num_drafted, num_accepted)
        self._global.add(num_drafted, num_accepted)

    def release(self, seq_id: int) -> None:
        self._requests.pop(seq_id, None)
        self.trees.release(seq_id)


def _emitted(surv: Sequence[float], k: int) -> float:
    """Expected tokens a step with ``k`` drafts emits: the recovered or bonus token, plus each
    draft's chance of being reached and accepted."""
    return 1.0 + math.fsum(surv[:k])


def _catchup(surv: Sequence[Sequence[float]], switch: Sequence[float], ks: Sequence[int]) -> float:
    """A plan's catch-up seconds this step: each drafting request's per-token share times the
    tokens it is expected to emit."""
    return math.fsum(c * _emitted(s, k) for s, c, k in zip(surv, switch, ks) if k > 0)


def _gains(
    surv: Sequence[Sequence[float]], caps: Sequence[int], width: int
) -> list[tuple[float, int]]:
    """``(s_r(j), r)`` for every request ``r`` and draft ``j <= min(width, cap_r)``, largest
    first: ``s_r(j)`` is what the ``j``-th draft adds to the request's expected emitted tokens
    (never more than the ``(j-1)``-th adds: a product of one more acceptance)."""
    gains = [
        (s[j - 1], r)
        for r, (s, cap) in enumerate(zip(surv, caps))
        for j in range(1, min(width, cap) + 1)
    ]
    gains.sort(key=lambda g: -g[0])  # stable: a request's j-th gain stays after its (j-1)-th
    return gains
