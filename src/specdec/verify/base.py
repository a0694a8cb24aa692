"""What the chain and tree verifiers share: the ``kernels`` choice and the checks of a call.

:class:`RuleVerifier` is the one base of :class:`~specdec.verify.chain.ChainVerifier` and
:class:`~specdec.verify.tree.TreeVerifier`: its :meth:`~RuleVerifier.verify` checks what every
proposal kind needs (the kind, one ``SamplingParams`` and one generator per sequence, the
shape of ``draft_probs`` and ``sampling``) before any work, then hands the call to the
subclass's own shape check and rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.sampling import RowRandom, SamplingTensors
from specdec.types import DraftProposal, ProposalKind, VerifyResult
from specdec.verify.kernel_choice import KernelChoice, check_kernel_choice

__all__ = ["RuleVerifier"]


class RuleVerifier:
    """A :class:`~specdec.interfaces.Verifier` of one :class:`ProposalKind`, with ``kernels``
    choosing its implementation (:mod:`specdec.verify.kernel_choice`).

    Subclasses set :attr:`kind` and implement :meth:`_counts` (their shape checks) and
    :meth:`_verify` (their rules).
    """

    kind: ProposalKind
    kernels: KernelChoice = "auto"  # a class default: subclasses need not call __init__

    def __init__(self, kernels: KernelChoice = "auto"):
        self.kernels = check_kernel_choice(kernels)

    def verify(
        self,
        target_logits: torch.Tensor,  # [batch, width + 1, vocab] float
        proposal: DraftProposal,
        params: Sequence[SamplingParams],
        generators: Sequence[RowRandom],
        *,
        sampling: SamplingTensors | None = None,  # params as tensors, one row per sequence
    ) -> VerifyResult:
        """Each sequence's longest acceptable draft prefix and its recovered or bonus token."""
        if proposal.kind is not self.kind:
            raise ValueError(
                f"{type(self).__name__} verifies {self.kind.name} proposals, got {proposal.kind}"
            )
        counts = self._counts(target_logits, proposal)
        batch, width = proposal.batch_size, proposal.width
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"need one SamplingParams and one generator per sequence ({batch}), "
                f"got {len(params)} and {len(generators)}"
            )
        expected = (batch, width, target_logits.shape[2])
        if proposal.draft_probs is not None and proposal.draft_probs.shape != expected:
            raise ValueError(
                f"draft_probs must be [batch, width, vocab] = {expected}, "
                f"got {tuple(proposal.draft_probs.shape)}"
            )
        if sampling is not None and sampling.num_rows != batch:
            raise ValueError(
                f"sampling must have one row per sequence ({batch}), got {sampling.num_rows}"
            )
        return self._verify(target_logits, proposal, params, generators, sampling, counts)

    def _counts(self, target_logits: torch.Tensor, proposal: DraftProposal) -> tuple[int, ...]:
        """The proposal's shapes checked against ``target_logits``; its draft counts."""
        raise NotImplementedError

    def _verify(
        self, target_logits, proposal, params, generators, sampling, counts
    ) -> VerifyResult:
        """The rules, on arguments :meth:`verify` has checked."""
        raise NotImplementedError
