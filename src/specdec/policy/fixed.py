"""The fixed policy: the same k for every request and step (the behaviour before the adaptive
policy; ``FixedPolicy(0)`` keeps the proposer but switches speculation off).

Example:
    >>> FixedPolicy(3)
    FixedPolicy(3)
"""

from __future__ import annotations

from specdec.config import check_arg, non_negative_int
from specdec.interfaces import SpeculationContext

__all__ = ["FixedPolicy"]


class FixedPolicy:
    """Always draft ``k`` tokens (fewer only where a request's remaining budget is smaller).

    ``k = 0`` switches speculation off while keeping the proposer. ``k`` above the proposer's
    ``num_speculative_tokens`` is rejected when the generator is built.

    Example:
        >>> gen = Generator.from_pretrained(target, proposer=draft, policy=FixedPolicy(3))
    """

    def __init__(self, k: int) -> None:
        check_arg(non_negative_int, "k", k)
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
