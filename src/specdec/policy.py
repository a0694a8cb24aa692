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
- each request's per-position acceptance (:func:`acceptance_estimate`).

With acceptance ``a`` and ``k`` drafts a step emits :func:`expected_emitted` ``(1 - a^(k+1)) /
(1 - a)`` tokens on average (a draft is kept only if every earlier one was). :class:`FixedPolicy`
always drafts the same k (the behaviour before the adaptive policy).

Example:
    >>> gen = Generator.from_pretrained(target, proposer=draft)                  # adaptive
    >>> gen = Generator.from_pretrained(target, proposer=draft, policy=FixedPolicy(4))
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Sequence

import attrs

from specdec.config import positive_int
from specdec.interfaces import SpeculationContext
from specdec.tree_policy import TreeSizer
from specdec.types import ProposalKind

__all__ = [
    "AdaptivePolicy",
    "AdaptivePolicyConfig",
    "CostCurve",
    "cost_bucket",
    "Extrapolation",
    "FixedPolicy",
    "acceptance_estimate",
    "expected_emitted",
]


# ----------------------------------------------------------------------------- pure functions


def expected_emitted(a: float, k: int) -> float:
    """Expected tokens one verification step emits: ``(1 - a^(k+1)) / (1 - a)``.

    ``a`` is the per-position acceptance (each draft is accepted with probability ``a`` given
    that every earlier one was), ``k`` the number of drafts; the recovered or bonus token counts,
    so ``k = 0`` (a plain step) gives 1 and ``a -> 1`` gives ``k + 1``.

    Example:
        >>> expected_emitted(0.5, 2)
        1.75
    """
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


# ----------------------------------------------------------------------------- cost curves

EXACT_SIZES = 16  # sizes below this each get their own cost point


def cost_bucket(size: float) -> int:
    """The cost-curve bucket of ``size`` (>= 1): the size itself below :data:`EXACT_SIZES`,
    one bucket per power of two above.

    Why exact small sizes: a CPU matmul kernel works in blocks of rows (6 in specdec's bf16
    kernel), so a pass's cost steps up between two row counts (6 -> 7 rows: 1.3x -> ~1.8x a
    1-row pass); a bucket averaging 4-7 rows would price 7 rows like 6 and 5 like 6.

    >>> [cost_bucket(s) for s in (1, 6, 7, 15, 16, 31, 32)]
    [1, 6, 7, 15, 16, 16, 17]
    """
    if size < EXACT_SIZES:
        return int(size)
    return EXACT_SIZES + int(math.log2(size)) - int(math.log2(EXACT_SIZES))


class Extrapolation(enum.Enum):
    """What a :class:`CostCurve` assumes past its largest measured point."""

    PROPORTIONAL = "proportional"  # cost grows like the size: pessimistic for concave costs
    FLAT = "flat"  # cost stays at the largest point's: optimistic for growing costs


class CostCurve:
    """Seconds of an operation as a function of a size, learned from observations.

    One exponential moving average of ``(size, seconds)`` per bucket of sizes (:func:`cost_bucket`:
    each size below 16 alone, power-of-two buckets above); :meth:`estimate` interpolates
    linearly between the bucket points, made non-decreasing.
    Below the smallest point the cost scales with the size (a lower bound when per-unit cost
    falls with size); above the largest it follows ``above``.

    Between measured points the true curve may be concave (the chord under-estimates) or
    convex: on a CPU a pass costs about the same for 1-6 rows and then grows linearly, so the
    chord from one row to a long prefill *over*-estimates a 5-row verify pass several times
    over. ``estimate(size, optimistic=True)`` therefore prices a size whose bucket has no
    measurement yet at the nearest measured cost below it (a lower bound: costs do not fall
    with size): a policy tries such a size once, measures it, and corrects.

    Example:
        >>> curve = CostCurve(decay=0.8)
        >>> curve.observe(1, 0.150); curve.observe(64, 0.900)
        >>> round(curve.estimate(8), 3)
        0.233
        >>> curve.estimate(8, optimistic=True)  # 8 rows not measured yet
        0.15
    """

    def __init__(self, decay: float, above: Extrapolation = Extrapolation.PROPORTIONAL) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self.above = above
        self._points: dict[int, tuple[float, float]] = {}  # bucket -> (size, seconds) averages
        self._xs: list[float] = []  # sorted sizes of the points
        self._ys: list[float] = []  # their seconds, running maximum (non-decreasing)

    @property
    def measured(self) -> bool:
        return bool(self._points)

    def observe(self, size: float, seconds: float) -> None:
        """Fold one measurement in (sizes < 1 and non-finite or negative times are ignored)."""
        if size < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        bucket = cost_bucket(size)
        old = self._points.get(bucket)
        if old is None:
            self._points[bucket] = (float(size), float(seconds))
        else:
            d = self.decay
            self._points[bucket] = (d * old[0] + (1 - d) * size, d * old[1] + (1 - d) * seconds)
        points = sorted(self._points.values())
        self._xs = [x for x, _ in points]
        self._ys = []
        top = 0.0
        for _, y in points:
            top = max(top, y)
            self._ys.append(top)

    def measured_at(self, size: float) -> bool:
        """Whether ``size``'s bucket has a measurement."""
        return size >= 1 and cost_bucket(size) in self._points

    def estimate(self, size: float, *, optimistic: bool = False) -> float:
        """Estimated seconds at ``size``; 0.0 before any observation. ``optimistic``: an
        unmeasured bucket costs what the nearest measured size below it costs."""
        xs, ys = self._xs, self._ys
        if not xs or size <= 0:
            return 0.0
        if optimistic and size > xs[0] and not self.measured_at(size):
            return ys[bisect.bisect_right(xs, size) - 1]
        if size <= xs[0]:
            return ys[0] * size / xs[0]
        if size >= xs[-1]:
            return ys[-1] * size / xs[-1] if self.above is Extrapolation.PROPORTIONAL else ys[-1]
        i = bisect.bisect_right(xs, size)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)


# ----------------------------------------------------------------------------- policies


class FixedPolicy:
    """Always draft ``k`` tokens (fewer only where a request's remaining budget is smaller).

    ``k = 0`` switches speculation off while keeping the proposer. ``k`` above the proposer's
    ``num_speculative_tokens`` is rejected when the generator is built.

    Example:
        >>> gen = Generator.from_pretrained(target, proposer=draft, policy=FixedPolicy(3))
    """

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"k must be an int >= 0, got {type(k).__name__}")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def __repr__(self) -> str:
        return f"FixedPolicy({self.k})"

    def choose(self, ctx: SpeculationContext) -> tuple[int, ...]:
        return tuple(min(self.k, ctx.max_k, cap) for cap in ctx.caps)

    def observe_target(self, rows: int, seconds: float) -> None:
        """Fixed: nothing to learn."""

    def observe_propose(self, batch: int, width: int, seconds: float, unseen: int) -> None:
        """Fixed: nothing to learn."""

    def observe_verify(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """Fixed: nothing to learn."""

    def release(self, seq_id: int) -> None:
        """No per-request state."""


def _unit_open(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a number in [0, 1)."""
    _number(attribute, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1), got {value!r}")


def _unit_closed(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a number in [0, 1]."""
    _number(attribute, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a finite number > 0."""
    _number(attribute, value)
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _number(attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{attribute.name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be finite, got {value!r}")


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

    decay: float = attrs.field(default=0.9, validator=_unit_open)
    global_decay: float = attrs.field(default=0.99, validator=_unit_open)
    prior_acceptance: float = attrs.field(default=0.6, validator=_unit_closed)
    prior_weight: float = attrs.field(default=5.0, validator=_positive)
    cost_decay: float = attrs.field(default=0.8, validator=_unit_open)
    probe_budget: float = attrs.field(default=0.01, validator=_positive)
    min_probe_interval: int = attrs.field(default=8, validator=positive_int)


@attrs.define
class _Counts:
    """Decayed acceptance counts of one request (or of the whole generator)."""

    accepted: float = 0.0
    rejections: float = 0.0
    zero_run: int = 0  # consecutive decode steps at k = 0

    def add(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        self.accepted = decay * self.accepted + num_accepted
        self.rejections = decay * self.rejections + (1.0 if num_accepted < num_drafted else 0.0)


class AdaptivePolicy:
    """Per request and per step, the k that maximises the expected emitted tokens per second.

    For a plan ``k_r`` over the batch the step emits ``sum_r expected_emitted(a_r, k_r)``
    tokens in ``T(sum_r (k_r + 1)) + D(n) * max_r k_r + sum_{k_r > 0} S_r`` seconds, where
    ``T`` is the measured cost of a step's target work by its rows, ``D(n)`` the measured
    seconds per drafted token when ``n`` requests draft (only requests with ``k_r > 0`` are
    sent to the proposer), ``a_r`` the request's acceptance estimate, and ``S_r`` the
    proposer's catch-up on the request's unseen tokens spread over the steps it has left
    (:meth:`catchup_seconds`; zero for a request that drafted last step). For each drafting
    width ``W`` the marginal gains ``a_r^j`` (``j <= W``) are taken in decreasing order and the
    prefix with the best rate is kept; each such plan is polished by single +-1 changes, and
    the best plan wins. All zeros (a plain step) wins unless something beats it.

    Cold start: target passes of a row count whose bucket has not been measured are priced
    optimistically (:meth:`CostCurve.estimate` with ``optimistic=True``), so a fresh policy
    tries speculating as soon as a plain step has been measured, and each row-count bucket is
    tried at most once before real costs decide. The proposer's cost is unknown until it first
    drafts; at batch size > 1 that first drafting step drafts for one request only.

    Probing: a request at k = 0 is never measured again, so once it has spent enough steps at
    k = 0 that one probe step (k = 1, including what the proposer must catch up on) costs at
    most ``probe_budget`` of that time, and only if it would draft were its acceptance as good
    as the generator's, it drafts one token.

    Trees: for a tree proposer (``ctx.kind`` TREE) k counts tree nodes and the choice is one
    tree size for the step, from the measured accepted length per size and drafting cost per
    step (:class:`~specdec.tree_policy.TreeSizer`). The first tree context switches the policy's
    observations of drafting and verification to the tree model.

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
        self.trees = TreeSizer(config.decay, config.cost_decay)
        self._trees = False

    def __repr__(self) -> str:
        return f"AdaptivePolicy({self.config!r})"

    # ------------------------------------------------------------------ estimates
    def acceptance(self, seq_id: int) -> float:
        """The request's acceptance estimate (the generator-wide one for a new request)."""
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

    def step_seconds(self, rows: int, drafting: int, width: int) -> float:
        """Estimated seconds of a step: ``rows`` target rows, ``drafting`` requests drafting
        ``width`` tokens."""
        draft = self.draft_cost.estimate(drafting) * width if width > 0 else 0.0
        return self.target_cost.estimate(rows, optimistic=True) + draft

    def catchup_seconds(self, unseen: int) -> float:
        """Estimated extra drafting time for ``unseen`` tokens the proposer has not seen.

        A stateful proposer (a draft model) runs them through its first forward. Measured from
        ``propose`` calls that had tokens to catch up on; before the first, that forward is
        assumed to cost like the target's over the same rows, scaled by the measured ratio of
        one drafted token to one target row.
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
            return self.trees.choose(ctx, self.target_cost)
        caps = [min(c, ctx.max_k) for c in ctx.caps]
        for seq_id in ctx.seq_ids:
            self._requests.setdefault(seq_id, _Counts())
        if not self.target_cost.measured:
            ks = [0] * len(caps)  # no costs yet: a plain step measures one
        else:
            if not self.draft_cost.measured and len(caps) > 1:
                # The first drafting step prices the proposer (and its catch-up on a whole
                # prompt): one request, the one with the least to catch up on, pays for it.
                first = min(range(len(caps)), key=lambda r: ctx.unseen[r])
                caps = [c if r == first else 0 for r, c in enumerate(caps)]
            acc = [self.acceptance(s) for s in ctx.seq_ids]
            switch = [self._switch_seconds(ctx, acc, r) for r in range(len(caps))]
            ks = self._plan(acc, caps, switch)
            self._add_probes(ctx, acc, caps, ks, switch)
        for seq_id, k in zip(ctx.seq_ids, ks):
            counts = self._requests[seq_id]
            counts.zero_run = counts.zero_run + 1 if k == 0 else 0
        return tuple(ks)

    def _switch_seconds(self, ctx: SpeculationContext, acc: Sequence[float], r: int) -> float:
        """Seconds per step that drafting for request ``r`` costs on top of its drafts: the
        proposer's catch-up on its unseen tokens, spread over the steps the request has left if
        it keeps drafting (a request about to finish does not pay for a long catch-up)."""
        if ctx.unseen[r] <= 0:
            return 0.0
        remaining = ctx.caps[r] + 1
        per_step = expected_emitted(acc[r], min(ctx.max_k, ctx.caps[r]))
        return self.catchup_seconds(ctx.unseen[r]) / max(1.0, remaining / per_step)

    def _rate(
        self, emitted: float, rows: int, drafting: int, width: int, extra: float = 0.0
    ) -> float:
        seconds = self.step_seconds(rows, drafting, width) + extra
        return emitted / seconds if seconds > 0 else math.inf

    def _plan(
        self, acc: Sequence[float], caps: Sequence[int], switch: Sequence[float]
    ) -> list[int]:
        """For each width, the best prefix of the marginal gains; each refined; the best wins."""
        batch = len(acc)
        plans = [[0] * batch]
        for width in range(1, max(caps, default=0) + 1):
            gains = _gains(acc, caps, width)
            emitted, rows, drafting, extra, taken = float(batch), batch, 0, 0.0, [0] * batch
            best_rate, best_m = 0.0, 0
            for m, (gain, r) in enumerate(gains, start=1):
                emitted += gain
                rows += 1
                if taken[r] == 0:
                    drafting += 1
                    extra += switch[r]
                taken[r] += 1
                rate = self._rate(emitted, rows, drafting, width, extra)
                if rate > best_rate:
                    best_rate, best_m = rate, m
            ks = [0] * batch
            for _, r in gains[:best_m]:
                ks[r] += 1
            plans.append(ks)
        refined = [self._refine(acc, caps, switch, ks) for ks in plans]
        return max(refined, key=lambda ks: self._plan_rate(acc, switch, ks))

    def _plan_rate(self, acc: Sequence[float], switch: Sequence[float], ks: Sequence[int]) -> float:
        emitted = sum(expected_emitted(a, k) for a, k in zip(acc, ks))
        extra = sum(s for s, k in zip(switch, ks) if k > 0)
        return self._rate(emitted, sum(k + 1 for k in ks), sum(k > 0 for k in ks), max(ks), extra)

    def _refine(
        self, acc: Sequence[float], caps: Sequence[int], switch: Sequence[float], ks: list[int]
    ) -> list[int]:
        """Hill-climb from ``ks`` by single +-1 changes while the estimated rate improves.

        The prefix search above ignores that a request's first draft also makes one more
        request draft (``D(n)`` grows with ``n``) and may cost a catch-up; a few moves repair
        that.
        """
        emitted = sum(expected_emitted(a, k) for a, k in zip(acc, ks))
        rows = sum(k + 1 for k in ks)
        drafting = sum(k > 0 for k in ks)
        extra = sum(s for s, k in zip(switch, ks) if k > 0)
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
                        emitted + acc[r] ** (k + 1),
                        rows + 1,
                        drafting + (k == 0),
                        max(width, k + 1),
                        extra + (switch[r] if k == 0 else 0.0),
                    )
                    if new > rate:
                        rate, move = new, (r, 1)
                if k > 0:
                    new = self._rate(
                        emitted - acc[r] ** k,
                        rows - 1,
                        drafting - (k == 1),
                        width - 1 if k == width and counts[k] == 1 else width,
                        extra - (switch[r] if k == 1 else 0.0),
                    )
                    if new > rate:
                        rate, move = new, (r, -1)
            if move is None:
                break
            r, step = move
            k = ks[r]
            counts[k] -= 1
            emitted += acc[r] ** (k + 1) if step > 0 else -(acc[r] ** k)
            if step > 0 and k == 0:
                drafting, extra = drafting + 1, extra + switch[r]
            elif step < 0 and k == 1:
                drafting, extra = drafting - 1, extra - switch[r]
            ks[r] = k + step
            counts[k + step] += 1
            rows += step
            width = max(j for j, c in enumerate(counts) if c)
        return ks

    def _add_probes(
        self,
        ctx: SpeculationContext,
        acc: Sequence[float],
        caps: Sequence[int],
        ks: list[int],
        switch: Sequence[float],
    ) -> None:
        c = self.config
        batch = len(ks)
        optimistic = max(self.global_acceptance(), c.prior_acceptance)
        for r, seq_id in enumerate(ctx.seq_ids):
            zero_run = self._requests[seq_id].zero_run + 1  # counting this step
            if ks[r] > 0 or caps[r] == 0 or zero_run < c.min_probe_interval:
                continue
            rows = sum(k + 1 for k in ks)
            drafting = sum(k > 0 for k in ks)
            width = max(ks)
            emitted = sum(expected_emitted(a, k) for a, k in zip(acc, ks))
            extra = sum(s for s, k in zip(switch, ks) if k > 0)
            now = self.step_seconds(rows, drafting, width) + extra
            rate = emitted / now if now > 0 else math.inf
            # Worth knowing only if a good acceptance would make this request draft.
            if not any(
                self._rate(
                    emitted - 1 + expected_emitted(optimistic, j),
                    rows + j,
                    drafting + 1,
                    max(width, j),
                    extra + switch[r],
                )
                > rate
                for j in range(1, caps[r] + 1)
            ):
                continue
            # What the probe step loses against the plan: its extra time (one more verify row,
            # the draft token, the catch-up) less the time the plan would take to emit the
            # a_r tokens the probe is expected to add.
            cost = (
                self.step_seconds(rows + 1, drafting + 1, max(width, 1))
                + extra
                - now
                + self.catchup_seconds(ctx.unseen[r])
                - acc[r] * now / emitted
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
            self.trees.observe_propose(batch, width, seconds)
            return
        if unseen <= 0:
            self.draft_cost.observe(batch, seconds / width)
            return
        # The call also caught up on unseen tokens: split its time into drafting and catch-up.
        if self.draft_cost.measured:
            per_token = self.draft_cost.estimate(batch)
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

    def observe_verify(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return  # nothing was judged
        if self._trees:
            self.trees.observe_verify(seq_id, num_drafted, num_accepted)
            return
        counts = self._requests.setdefault(seq_id, _Counts())
        counts.add(num_drafted, num_accepted, self.config.decay)
        self._global.add(num_drafted, num_accepted, self.config.global_decay)

    def release(self, seq_id: int) -> None:
        self._requests.pop(seq_id, None)
        self.trees.release(seq_id)


def _gains(acc: Sequence[float], caps: Sequence[int], width: int) -> list[tuple[float, int]]:
    """``(a_r^j, r)`` for every request ``r`` and draft ``j <= min(width, cap_r)``, largest
    first: ``a_r^j`` is what the ``j``-th draft adds to ``expected_emitted(a_r, .)``."""
    gains = [
        (a**j, r)
        for r, (a, cap) in enumerate(zip(acc, caps))
        for j in range(1, min(width, cap) + 1)
    ]
    gains.sort(key=lambda g: -g[0])  # stable: a request's j-th gain stays after its (j-1)-th
    return gains
