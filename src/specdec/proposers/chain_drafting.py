"""The drafting loop of every chain proposer (the draft model, the MTP head): k steps of "logits
for the next position -> a draft token", one loop, each proposer supplying only its step.

Each step drafts one token per row: the argmax when every request of the batch is greedy, else
a draw from the processed draft distribution (temperature, top-k, top-p, min-p; one-hot for the
greedy rows), whose probabilities the chain verifier needs. With ``confidence_threshold`` a
row's chain ends after the first token it drafts with lower draft probability, and drafting
stops when every chain has ended (:mod:`specdec.proposers.confidence`): k is then a ceiling.
The drafts stay on the device: a step gets the previous step's tokens as a tensor, so drafting
reads nothing back (the confidence rule reads each step's confidences: the one host read, and
only with a threshold).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from specdec.config import speculative_tokens, unit_interval_closed_open
from specdec.proposers.confidence import chains_end
from specdec.sampling import SamplingTensors, processed_probs, sample_from_probs, shift_rows
from specdec.types import PAD_TOKEN_ID

__all__ = ["ChainProposerConfig", "DraftedChain", "NextLogits", "draft_chain"]


@attrs.frozen(kw_only=True)
class ChainProposerConfig:
    """The settings of a chain proposer (:class:`~specdec.proposers.DraftModel`,
    :class:`~specdec.proposers.MTPHead`).

    Example:
        >>> ChainProposerConfig(num_speculative_tokens=3, confidence_threshold=0.3)
        ChainProposerConfig(num_speculative_tokens=3, confidence_threshold=0.3)
    """

    num_speculative_tokens: int = attrs.field(default=4, validator=speculative_tokens)
    # A chain ends after a draft token of lower draft probability (softmax of the draft's raw
    # logits); 0 drafts every chain to k.
    confidence_threshold: float = attrs.field(default=0.0, validator=unit_interval_closed_open)


class NextLogits(Protocol):
    """One drafting step of a chain proposer: its draft logits for position ``step``."""

    def __call__(
        self,
        step: int,  # 0 .. k-1
        previous: torch.Tensor | None,  # [rows] int64 the drafts of step - 1 (None at step 0;
        # PAD (-1) where a row's draft had no distribution: a valid id must stand in for it)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``logits [rows, columns]`` and the token id of each column (``None``: the columns are
        the whole vocabulary in id order)."""
        ...


@attrs.frozen(eq=False)
class DraftedChain:
    """What :func:`draft_chain` drafted, as wide as the steps it took."""

    token_ids: torch.Tensor  # [rows, steps] int64, PAD_TOKEN_ID past each row's chain
    num_draft_tokens: tuple[int, ...]  # per row: the length of its chain
    probs: torch.Tensor | None  # [rows, steps, vocab] draft distributions; None when all greedy


def draft_chain(
    next_logits: NextLogits,
    k: int,
    *,
    greedy: bool,  # every request of the batch is greedy: argmax drafts, no distributions
    sampling: SamplingTensors | None,  # one row per drafted row (needed unless greedy)
    generators: Sequence[object],  # one per row: draft step j draws from shift_rows(., j)
    confidence_threshold: float = 0.0,
    transforms: Sequence[object | None] = (),  # per row: ProposeContext.logits_transforms
) -> DraftedChain:
    """Draft up to ``k`` tokens per row with ``next_logits`` (the module docstring).

    Example:
        >>> step = lambda j, previous: (torch.tensor([[0.0, 5.0], [5.0, 0.0]]), None)
        >>> draft_chain(step, 2, greedy=True, sampling=None, generators=[None, None]).token_ids
        tensor([[1, 1],
                [0, 0]])
    """
    drafted: list[torch.Tensor] = []  # steps x [rows] int64
    probs: list[torch.Tensor] = []  # steps x [rows, vocab]
    num_draft: list[int] = [k] * len(generators)  # where each chain ends
    tokens: torch.Tensor | None = None  # [rows] the last step's drafts, kept on the device
    for step in range(k):
        logits, columns = next_logits(step, tokens)  # [rows, columns]
        if any(t is not None for t in transforms):
            logits = _transformed(logits, columns, transforms, drafted)
        if greedy:
            picked = logits.argmax(dim=-1)  # [rows] column indices
            tokens = picked if columns is None else columns[picked]
        else:
            if columns is not None:  # a draft vocabulary's columns are not token ids
                raise ValueError("next_logits returned draft-vocabulary columns for a sampled chain; "
                                 "sampled drafts need full-vocabulary logits")
            step_probs = processed_probs(logits, sampling)  # one-hot rows for greedy requests
            tokens = picked = sample_from_probs(step_probs, shift_rows(generators, step))
            probs.append(step_probs)
        drafted.append(tokens)
        if confidence_threshold > 0 and chains_end(logits, picked, confidence_threshold, step, num_draft):
            break
    token_ids = torch.stack(drafted, dim=1)  # [rows, steps]
    ended = torch.arange(len(drafted)).unsqueeze(0) >= torch.tensor(num_draft).unsqueeze(1)
    return DraftedChain(
        token_ids=token_ids.masked_fill(ended.to(token_ids.device), PAD_TOKEN_ID),
        num_draft_tokens=tuple(num_draft),
        probs=torch.stack(probs, dim=1) if probs else None,
    )


def _transformed(
    logits: torch.Tensor,  # [rows, columns] draft logits of one step
    columns: torch.Tensor | None,  # [columns] token id of each column; None: the vocabulary
    transforms: Sequence[object | None],
    drafted: list[torch.Tensor],  # steps so far x [rows] int64
) -> torch.Tensor:  # [rows, columns]
    """The rows with request options, transformed with their drafts so far as the history
    (one host read of the drafts per step, only for requests with options)."""
    out = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
    history = torch.stack(drafted, dim=1).tolist() if drafted else [[] for _ in transforms]
    for i, transform in enumerate(transforms):
        if transform is None:
            continue
        if columns is None:
            out[i] = transform([history[i]], out[i : i + 1])[0]
            continue
        # A draft vocabulary: its columns placed at their token ids, every other id masked.
        full = torch.full((1, int(columns.max()) + 1), -torch.inf, dtype=out.dtype, device=out.device)
        full[0, columns] = out[i]
        out[i] = transform([history[i]], full)[0, columns]
    return out
