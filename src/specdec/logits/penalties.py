"""Repetition, frequency and presence penalties, per row of logits, from token counts.

Pure functions of ``(logits, counts)``: the caller builds each row's counts from exactly that
row's history (prompt + output + the drafts before the row), which is what keeps a penalised
request lossless under speculation.

- ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``): a token seen in
  the prompt or the output has its logit divided by the penalty when positive, multiplied when
  negative.
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI's rule): over output tokens only,
  ``logit -= frequency * count + presence * (count > 0)``.

Example:
    >>> counts = row_counts([], [[5], [5, 5]], vocab=8, device="cpu")  # [2, 8]
    >>> additive_penalties(torch.zeros(2, 8), counts, frequency=0.5, presence=1.0)[:, 5]
    tensor([-1.5000, -2.0000])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["additive_penalties", "repetition_penalty", "row_counts"]


def row_counts(
    base_ids: Sequence[int],
    extensions: Sequence[Sequence[int]],
    vocab: int,
    device: torch.device | str,
) -> torch.Tensor:
    """``[rows, vocab]`` float32: how often each token occurs in ``base_ids + extensions[r]``.

    Token ids outside ``[0, vocab)`` are not counted (a draft model's padding columns).
    """
    rows = len(extensions)
    base = torch.zeros(vocab, dtype=torch.float32, device=device)  # [vocab]
    ids = [t for t in base_ids if 0 <= t < vocab]
    if ids:
        base.index_add_(
            0,
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.ones(len(ids), dtype=torch.float32, device=device),
        )
    counts = base.unsqueeze(0).repeat(rows, 1)  # [rows, vocab]
    row_idx = [r for r, ext in enumerate(extensions) for t in ext if 0 <= t < vocab]
    tok_idx = [t for ext in extensions for t in ext if 0 <= t < vocab]
    if tok_idx:
        index = (
            torch.tensor(row_idx, dtype=torch.int64, device=device),
            torch.tensor(tok_idx, dtype=torch.int64, device=device),
        )
        counts.index_put_(index, torch.ones(len(tok_idx), device=device), accumulate=True)
    return counts


def repetition_penalty(
    logits: torch.Tensor,  # [rows, vocab] float
    seen: torch.Tensor,  # [rows, vocab] bool: the token occurs in the row's prompt + output
    penalty: float,
) -> torch.Tensor:  # [rows, vocab]
    """transformers' rule: seen tokens' logits ``/ penalty`` if > 0 else ``* penalty``."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def additive_penalties(
    logits: torch.Tensor,  # [rows, vocab] float
    counts: torch.Tensor,  # [rows, vocab] output-token counts of each row's history
    *,
    frequency: float,
    presence: float,
) -> torch.Tensor:  # [rows, vocab]
    """OpenAI's rule: ``logit - frequency * count - presence * (count > 0)``."""
    counts = counts.to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
