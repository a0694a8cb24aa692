"""The request options of a whole batch: each request's rows transformed with their histories.

The engine calls :func:`transform_rows` on the target's logits of a step (plain or verify) and
:func:`draft_transforms` to give chain proposers the same transform for their draft rows;
:func:`first_dead` finds where a request must end because a row it reached had no token left.

Example:
    >>> logits, dead = transform_rows(reqs, logits, histories, errors)  # [batch, rows, vocab]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.request import Request

__all__ = ["draft_transforms", "first_dead", "transform_rows"]

# A draft row's transform: (extensions, logits [rows, width]) -> logits, for one request.
DraftTransform = Callable[[Sequence[Sequence[int]], torch.Tensor], torch.Tensor]


def transform_rows(
    reqs: Sequence[Request],
    logits: torch.Tensor,  # [batch, rows, vocab] float, raw target logits
    histories: Sequence[Sequence[Sequence[int]]],  # per request: one extension per judged row
    errors: dict[int, BaseException],
) -> tuple[torch.Tensor, list[frozenset[int]]]:
    """Each request's judged rows ``0 .. len(histories[i]) - 1`` transformed by its options
    (:class:`~specdec.logits.request_logits.RequestLogits`); other rows and requests without
    options are left as they are.

    Returns the logits (``logits`` itself when no request has options; else float32 or wider)
    and, per request, its dead rows. An exception from a request's options (a user processor)
    goes to ``errors[i]`` and fails that request only.
    """
    dead: list[frozenset[int]] = [frozenset()] * len(reqs)
    if all(r.transform is None for r in reqs):
        return logits, dead
    out = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if out is logits:
        out = logits.clone()
    for i, req in enumerate(reqs):
        if req.transform is None or i in errors:
            continue
        rows = len(histories[i])
        try:
            out[i, :rows], row_dead = req.transform.apply(req.output_ids, histories[i], out[i, :rows])
        except Exception as exc:  # noqa: BLE001 - a user's processor: fails this request only
            errors[i] = exc
            continue
        dead[i] = frozenset(r for r, d in enumerate(row_dead) if d)
    return out, dead


def first_dead(paths: Sequence[int], dead: frozenset[int]) -> int | None:
    """Index of the first token judged at a dead row (``paths[t]`` is token ``t``'s row), or
    ``None``: the tokens before it are kept and the request ends there."""
    if not dead:
        return None
    return next((t for t, row in enumerate(paths) if row in dead), None)


def draft_transforms(reqs: Sequence[Request]) -> tuple[DraftTransform | None, ...]:
    """Per request, its options as a transform of draft rows (``None`` without options): a
    chain proposer applies it to the logits it drafts from, with the drafts before each row as
    the extension, so its drafts follow the same constraints and are accepted as often."""
    return tuple(None if r.transform is None else _draft_transform(r) for r in reqs)


def _draft_transform(req: Request) -> DraftTransform:
    output = tuple(req.output_ids)  # fixed for the step: drafting never commits

    def apply(extensions: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        try:
            return req.transform.apply(output, extensions, logits)[0]
        except Exception:  # noqa: BLE001 - drafts are guesses: the verify pass meets the same
            return logits  # error and fails this request alone, not the proposer's whole batch

    return apply
