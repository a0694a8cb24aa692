"""The cost model: seconds of an operation as a function of its size, learned as it runs.

The adaptive policy prices a step by three :class:`CostCurve` s (target rows, drafted tokens per
drafting batch, a stateful proposer's catch-up) and the tree sizer by one per tree size. Sizes
fall into buckets (:func:`cost_bucket`): exact below :data:`EXACT_SIZES`, powers of two above.

Example:
    >>> cost_bucket(7), cost_bucket(40)
    (7, 17)
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable, Sequence

from specdec.config import check_arg, unit_interval_closed_open

__all__ = ["EXACT_SIZES", "CostCurve", "Extrapolation", "cost_bucket", "held_back_starts"]

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
        check_arg(unit_interval_closed_open, "decay", decay)
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

    @property
    def largest(self) -> float | None:
        """The largest measured size (an average within its bucket); ``None`` before any."""
        return self._xs[-1] if self._xs else None

    def estimate_like(self, size: float, like: CostCurve) -> float:
        """:meth:`estimate` at ``size``; past the largest measured size, grown from there as
        ``like`` grows (its estimates' ratio, never below 1) instead of extrapolated: a draft
        model's cost by batch grows as the target's pass does over as many rows."""
        seconds, top = self.estimate(size), self.largest
        if top is None or size <= top:
            return seconds
        base, now = like.estimate(top), like.estimate(size)
        return seconds * now / base if base > 0 and now > base else seconds

    def measured_up_to(self, size: float) -> bool:
        """Whether some measurement is of ``size`` or less (below the smallest, estimates are
        extrapolated: see :meth:`estimate`)."""
        return bool(self._xs) and self._xs[0] <= size

    def measured_at(self, size: float) -> bool:
        """Whether ``size``'s bucket has a measurement."""
        return size >= 1 and cost_bucket(size) in self._points

    def estimate(self, size: float, *, optimistic: bool = False) -> float:
        """Estimated seconds at ``size``; 0.0 before any observation. ``optimistic``: an
        unmeasured bucket below :data:`EXACT_SIZES`, or above every measured size, costs what
        the nearest measured size below it costs, grown along the measured chord
        (:meth:`_lower_bound`). Not between two measured sizes of
        :data:`EXACT_SIZES` or more: small CPU passes cost about the same and step with the
        kernel's row blocks, so a chord over-prices them, but larger ones are compute-bound
        and the chord between measured points (a decode step and a prefill) prices them
        well, while pricing 64 rows like 16 once made a batch of 16 try a 64-row verify pass
        (and every request's catch-up on its prompt) at 4x a plain step's cost."""
        xs, ys = self._xs, self._ys
        if not xs or size <= 0:
            return 0.0
        small_or_beyond = size < EXACT_SIZES or size > xs[-1]
        if optimistic and size > xs[0] and small_or_beyond and not self.measured_at(size):
            return self._lower_bound(bisect.bisect_right(xs, size) - 1, size)
        if size <= xs[0]:
            return ys[0] * size / xs[0]
        if size >= xs[-1]:
            return ys[-1] * size / xs[-1] if self.above is Extrapolation.PROPORTIONAL else ys[-1]
        i = bisect.bisect_right(xs, size)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)

    def _lower_bound(self, i: int, size: float) -> float:
        """The optimistic cost at ``size`` from measured point ``i`` below it: that point's cost
        grown along the chord from the smallest measured point to it (never above the next
        measured point). Costs are convex in the size (flat while weights dominate, then each
        row its compute), so the chord's slope under-estimates the slope beyond: still a lower
        bound, a policy still tries the size once. Flat (the point's own cost) priced 15 verify
        rows like 6 at batch 4: every request drafted and caught up on its prompt, 15 % lost."""
        xs, ys = self._xs, self._ys
        slope = (ys[i] - ys[0]) / (xs[i] - xs[0]) if xs[i] > xs[0] else 0.0
        grown = ys[i] + slope * (size - xs[i])
        return min(grown, ys[i + 1]) if i + 1 < len(xs) else grown


def held_back_starts(
    starting: Sequence[int],
    unseen: Sequence[int],
    catchup: Callable[[int], float],
    plain_seconds: float,
) -> set[int]:
    """Of the requests ``starting`` to draft this step (``unseen[r]`` tokens each for the
    proposer to catch up on, ``catchup(unseen)`` seconds), those that must wait: when their
    catch-ups together cost more than a plain step (``plain_seconds``), all but the one with
    the least to catch up on. A catch-up is paid at once and repaid only if drafting goes on,
    which the next steps' measurements may deny (a cold batch-4 step on a 1-thread CPU paid
    four catch-ups, 1.0 s, on an acceptance carried over from batch 1, and stopped drafting
    four steps later). The caller plans again without them, and that plan must beat a plain
    step on its own: kept as the first plan had it, one request starting alone at batch 4 was
    priced (by the policy itself) at 15 tokens/s against plain's 19 and taken anyway.

    Example:
        >>> sorted(held_back_starts([0, 1, 2], [40, 33, 50], lambda u: 0.01 * u, 0.2))
        [0, 2]
    """
    if len(starting) < 2 or sum(catchup(unseen[r]) for r in starting) <= plain_seconds:
        return set()
    first = min(starting, key=lambda r: unseen[r])
    return {r for r in starting if r != first}
