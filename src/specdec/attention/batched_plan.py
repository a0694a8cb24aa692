"""A step's KV gather indices and visibility mask for the whole batch at once.

:func:`~specdec.attention.torch_backend.visibility_mask` states the rule for one sequence; the
functions here build the same tensors for every sequence of a step with a fixed number of
tensor operations instead of a few per sequence. That loop was 38 % of a decode step's time at
batch 1024 on a tiny model (the statistical tests), and it runs on every CPU step (the kernel
reads the gather and the mask). tests/unit/test_batched_plan.py checks them against the
per-sequence rule.

Example:
    >>> gather_slots((4, 9), (0, 1, 2), (3, 2), page_size=4).tolist()
    [[16, 17, 18], [36, 37, 0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["batch_visibility", "gather_slots", "padded_rows", "padded_tree_masks", "row_indices"]


def gather_slots(
    pages: Sequence[int],  # [num_used_pages]
    indptr: Sequence[int],  # [batch + 1]
    kv_lens: Sequence[int],  # [batch]
    page_size: int,
) -> torch.Tensor:  # [batch, max_kv] int64
    """Flat pool slot of every KV position of every sequence (page CSR as FlashInfer takes
    it); padding past a sequence's ``kv_len`` reads slot 0."""
    kv = torch.tensor(kv_lens, dtype=torch.int64)  # [batch]
    max_kv = max(kv_lens)
    if not pages:
        return torch.zeros(len(kv_lens), max_kv, dtype=torch.int64)
    first = torch.tensor(indptr[:-1], dtype=torch.int64)  # [batch]
    j = torch.arange(max_kv, dtype=torch.int64)  # [max_kv]
    valid = j < kv.unsqueeze(1)  # [batch, max_kv]
    page = torch.where(valid, first.unsqueeze(1) + j // page_size, 0)  # index into pages
    slots = torch.tensor(pages, dtype=torch.int64)[page] * page_size + j % page_size
    return torch.where(valid, slots, 0)


def padded_tree_masks(
    flat: torch.Tensor,  # [sum(q_len_i ** 2)] bool, row-major [q_len, q_len] per sequence
    q_lens: Sequence[int],  # [batch]
) -> torch.Tensor:  # [batch, max_q, max_q] bool, False past a sequence's q_len
    """The per-sequence tree blocks of a layout's flat mask, padded into one tensor."""
    q = torch.tensor(q_lens, dtype=torch.int64)  # [batch]
    max_q = max(q_lens)
    offset = torch.cumsum(q * q, 0) - q * q  # [batch] where each block starts
    r = torch.arange(max_q).view(1, -1, 1)
    s = torch.arange(max_q).view(1, 1, -1)
    n = q.view(-1, 1, 1)
    inside = (r < n) & (s < n)  # [batch, max_q, max_q]
    index = torch.where(inside, offset.view(-1, 1, 1) + r * n + s, 0)
    return inside & flat.to(torch.bool)[index]


def batch_visibility(
    q_lens: Sequence[int],  # [batch]
    kv_lens: Sequence[int],  # [batch]
    trees: torch.Tensor | None = None,  # [batch, max_q, max_q] bool (padded_tree_masks)
    sliding_window: int | None = None,
) -> torch.Tensor:  # [batch, max_q, max_kv] bool
    """Which KV slots each new row of each sequence may attend to: sequence ``i``'s block
    ``[:q_len_i, :kv_len_i]`` is ``visibility_mask(q_len_i, kv_len_i, tree_i, sliding_window)``;
    a padding row (``r >= q_len_i``) sees slot 0 only (SDPA gives an all-masked row NaNs), and
    no row sees past its sequence's ``kv_len``."""
    q = torch.tensor(q_lens, dtype=torch.int64).view(-1, 1, 1)  # [batch, 1, 1]
    kv = torch.tensor(kv_lens, dtype=torch.int64).view(-1, 1, 1)
    max_q, max_kv = max(q_lens), max(kv_lens)
    start = kv - q  # the slot of each sequence's first new row
    r = torch.arange(max_q).view(1, -1, 1)  # [1, max_q, 1]
    c = torch.arange(max_kv).view(1, 1, -1)  # [1, 1, max_kv]
    visible = c <= start + r  # causal
    # Positions: a slot's own index, except a tree row's, which is the prefix length plus its
    # depth (the rows its mask marks, less itself).
    row_pos = start + r  # [batch, max_q, 1]
    col_pos = c.expand(len(q_lens), 1, max_kv)  # [batch, 1, max_kv]
    if trees is not None:
        rel = c - start  # [batch, 1, max_kv] column index among the new rows
        new = (rel >= 0) & (rel < q)
        at = torch.where(new, rel, 0).expand(-1, max_q, -1)  # [batch, max_q, max_kv]
        visible = torch.where(new, torch.gather(trees, 2, at), visible)
        depth = trees.sum(-1, keepdim=True) - 1  # [batch, max_q, 1]
        row_pos = start + depth
        col_pos = torch.where(new, start + torch.gather(depth.transpose(1, 2), 2, torch.where(new, rel, 0)), c)
    if sliding_window is not None:
        visible = visible & (col_pos > row_pos - sliding_window)
    return torch.where(r < q, visible, c == 0)


def padded_rows(q_lens: Sequence[int]) -> torch.Tensor:  # [sum(q_lens)] int64
    """Where each new row sits in the padded ``[batch * max_q]`` rows: sequence ``i``'s row
    ``r`` at ``i * max_q + r``.

    >>> padded_rows((2, 1, 3)).tolist()
    [0, 1, 3, 6, 7, 8]
    """
    max_q = max(q_lens)
    grid = torch.arange(len(q_lens) * max_q, dtype=torch.int64).view(len(q_lens), max_q)
    return grid[_real_rows(q_lens)]


def row_indices(q_lens: Sequence[int]) -> torch.Tensor:  # [sum(q_lens)] int64
    """Each new row's index among its sequence's new rows.

    >>> row_indices((2, 1, 3)).tolist()
    [0, 1, 0, 0, 1, 2]
    """
    max_q = max(q_lens)
    return torch.arange(max_q, dtype=torch.int64).expand(len(q_lens), max_q)[_real_rows(q_lens)]


def _real_rows(q_lens: Sequence[int]) -> torch.Tensor:  # [batch, max_q] bool
    """Which of the padded ``[batch, max_q]`` rows are real (``r < q_len_i``)."""
    return torch.arange(max(q_lens)).unsqueeze(0) < torch.tensor(q_lens, dtype=torch.int64).unsqueeze(1)
