"""Acceptance counters, per-position histograms and throughput, per request and per generator."""

from __future__ import annotations

import attrs

__all__ = ["SpecMetrics"]


@attrs.define
class SpecMetrics:
    """Running totals of one request or of a whole generator.

    *acceptance rate* = accepted / drafted; *mean accepted length* = tokens emitted by
    verification steps / verification steps (it counts the bonus or recovered token, as vLLM and
    the EAGLE papers do; plain decoding has 1.0). ``accepted_per_position[j]`` counts how often
    draft position ``j`` was accepted, ``drafted_per_position[j]`` how often it was drafted.

    ``k_histogram[k]`` counts the decode steps in which the speculation policy chose ``k``
    drafts for the request (``0``: speculation off that step; a request's decode steps at k = 0
    are plain decode steps, or rows without drafts inside a verify pass). Only decode-only steps
    of a generator with a proposer are counted; prefill and mixed steps are not. The number of
    tokens actually drafted can be lower than the chosen k (a prompt-lookup miss).
    """

    num_generated_tokens: int = 0
    num_target_forwards: int = 0
    num_verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted_in_verify: int = 0
    accepted_per_position: list[int] = attrs.field(factory=list)
    drafted_per_position: list[int] = attrs.field(factory=list)
    k_histogram: dict[int, int] = attrs.field(factory=dict)
    elapsed_s: float = 0.0

    def snapshot(self) -> SpecMetrics:
        """An independent copy (the totals go on changing while requests run)."""
        return attrs.evolve(
            self,
            accepted_per_position=list(self.accepted_per_position),
            drafted_per_position=list(self.drafted_per_position),
            k_histogram=dict(self.k_histogram),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        if not self.num_verify_steps:
            return 1.0
        return self.num_emitted_in_verify / self.num_verify_steps

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]

    def record_verify(
        self, num_drafted: int, num_accepted: int, num_emitted: int, depth: int | None = None
    ) -> None:
        """Count one sequence's verification step (``num_emitted`` after stop truncation).

        ``depth``: the deepest drafted position (a tree's depth; a chain's is its length, the
        default). Per-position counts are per depth: position ``j`` was drafted in a step whose
        proposal reached depth ``j + 1`` and accepted when the kept path did.
        """
        depth = num_drafted if depth is None else depth
        self.num_verify_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted_in_verify += num_emitted
        _grow(self.drafted_per_position, depth)
        _grow(self.accepted_per_position, depth)
        for j in range(depth):
            self.drafted_per_position[j] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def record_k(self, k: int) -> None:
        """Count one decode step in which the policy chose ``k`` drafts for the request."""
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1

    @property
    def mean_k(self) -> float:
        """Mean chosen k over the counted decode steps (0.0 when none were counted)."""
        steps = sum(self.k_histogram.values())
        return sum(k * n for k, n in self.k_histogram.items()) / steps if steps else 0.0

    def merge(self, other: SpecMetrics) -> None:
        """Add ``other``'s counts into this one (generator totals from request metrics)."""
        for name in (
            "num_generated_tokens",
            "num_target_forwards",
            "num_verify_steps",
            "num_drafted",
            "num_accepted",
            "num_emitted_in_verify",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
        ):
            _grow(mine, len(theirs))
            for j, v in enumerate(theirs):
                mine[j] += v
        for k, v in other.k_histogram.items():
            self.k_histogram[k] = self.k_histogram.get(k, 0) + v

    def as_dict(self) -> dict[str, object]:
        d = attrs.asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_second=self.tokens_per_second,
            per_position_acceptance=self.per_position_acceptance,
            mean_k=self.mean_k,
        )
        d["k_histogram"] = dict(sorted(self.k_histogram.items()))
        return d


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))
