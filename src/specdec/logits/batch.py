"""The request options of a whole batch: each request's rows transformed with their histories.

The engine calls :func:`transform_rows` on the target's logits of a step (plain or verify) and
:func:`draft_transforms` to give chain proposers the same transform for their draft rows;
:func:`first_dead` finds where a request must end because a row it reached had no token left.

Example:
    >>> logits, dead = transform_rows(reqs, logits, histories, errors)  # [batch, rows, vocab]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from specdec.request import Request

__all__ = ["DraftTransform", "draft_transforms", "first_dead", "transform_rows"]


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
    the extension, so its drafts follow the same constraints and are accepted as often; a
    proposer with ready-made drafts (lookup, a tree) keeps the :meth:`DraftTransform.allowed`
    ones."""
    return tuple(None if r.transform is None else DraftTransform(r, tuple(r.output_ids)) for r in reqs)


@attrs.frozen(eq=False)
class DraftTransform:
    """One request's options over draft rows, for one step (drafting never commits, so the
    committed output is fixed). Call it as ``transform(extensions, logits [rows, width])``."""

    request: Request
    output: tuple[int, ...]

    def __call__(self, extensions: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        try:
            return self.request.transform.apply(self.output, extensions, logits)[0]
        except Exception:  # noqa: BLE001 - drafts are guesses: the verify pass meets the same
            return logits  # error and fails this request alone, not the proposer's whole batch

    def allowed(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> tuple[list[int], list[int] | None]:
        """The drafts the options allow: a draft whose token they forbid after its path (a
        mask: allowed ids, bad words, ``min_tokens``, a grammar) is dropped with everything
        after it. A chain (``parents`` ``None``) keeps its allowed prefix; a tree (parents
        before children, ``-1`` for the root's children) keeps its allowed nodes, re-indexed.

        Example:
            >>> transform.allowed([5, 9, 2])              # [5] if 9 is banned after 5
            >>> transform.allowed([5, 7, 9], [-1, -1, 0])  # ([5, 7], [-1, -1]) likewise
        """
        if not tokens:
            return list(tokens), None if parents is None else []
        links = list(range(-1, len(tokens) - 1)) if parents is None else list(parents)
        paths: list[list[int]] = []  # per node: the tokens of its ancestors, root side first
        for p in links:
            paths.append([] if p < 0 else [*paths[p], tokens[p]])
        zeros = torch.zeros((len(tokens), self.request.transform.vocab_size), dtype=torch.float32)
        out = self(paths, zeros)  # [nodes, vocab]: -inf where a mask forbids
        ids = torch.tensor(list(tokens), dtype=torch.int64)
        ok = (out[torch.arange(len(tokens)), ids] > -torch.inf).tolist()
        index: dict[int, int] = {}  # kept node -> its new index
        for j, p in enumerate(links):
            if ok[j] and (p < 0 or p in index):
                index[j] = len(index)
        kept = list(index)
        new_parents = [-1 if links[j] < 0 else index[links[j]] for j in kept]
        return [tokens[j] for j in kept], None if parents is None else new_parents
