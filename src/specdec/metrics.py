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

    def record_verify(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """Count one sequence's verification step (``num_emitted`` after stop truncation)."""
        self.num_verify_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted_in_verify += num_emitted
        self.k_histogram[num_drafted] = self.k_histogram.get(num_drafted, 0) + 1
        _grow(self.drafted_per_position, num_drafted)
        _grow(self.accepted_per_position, num_drafted)
        for j in range(num_drafted):
            self.drafted_per_position[j] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

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
        )
        return d


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))
