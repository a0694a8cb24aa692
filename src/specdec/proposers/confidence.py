"""Ending draft chains where the draft hesitates (``confidence_threshold`` of chain proposers).

A chain ends after the first token its draft gives less than the threshold (that token is still
proposed): where the draft hesitates the target usually disagrees, so the drafting and the verify
rows saved cost little acceptance (the dynamic draft length of transformers' assisted generation
and of SpecDec++). The rule reads the draft's distribution only, never the target's, so the
verifiers stay exact. Trees have the analogue in :attr:`~specdec.proposers.tree_shape.TreeShape.min_path_prob`.
"""

from __future__ import annotations

import torch

__all__ = ["chains_end"]


def chains_end(
    logits: torch.Tensor,  # [batch, vocab] the draft's raw logits at this step
    picked: torch.Tensor,  # [batch] int64 the columns drafted from them
    threshold: float,
    step: int,
    num_draft: list[int],  # per sequence, updated in place: a chain ending here keeps step + 1
) -> bool:
    """End the chains whose drafted column has draft probability below ``threshold``; whether
    every chain has ended.

    >>> n = [3, 3]
    >>> chains_end(torch.tensor([[2.0, 0.0], [0.0, 0.0]]), torch.tensor([0, 1]), 0.6, 0, n), n
    (False, [3, 1])
    """
    confidence = (logits.gather(1, picked.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)).exp()
    for i, low in enumerate((confidence < threshold).tolist()):
        if low and num_draft[i] > step + 1:
            num_draft[i] = step + 1
    return all(n <= step + 1 for n in num_draft)
