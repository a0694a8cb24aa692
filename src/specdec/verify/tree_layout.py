"""Where a draft tree's nodes go in a verify pass, and where the kept path goes afterwards.

A sequence's verify rows are its root (the last emitted token, row 0) followed by its draft
nodes in proposal order (node ``j`` is row ``j + 1``). Parents come before children, so a row's
ancestors are rows before it. Each row is placed at RoPE position ``start + depth`` and sees the
committed prefix plus its own ancestors (the tree mask); its KV lands at slot ``start + row``.
After verification the kept path's KV is moved to slots ``start, start + 1, ...`` and the
proposer is told about the kept rows in path order.

All functions are pure: host lists in, host lists (or small bool tensors) out.

Example:
    >>> tree_depths([-1, -1, 0, 2], 4)
    [0, 1, 1, 2, 3]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_parents", "kept_first_order", "tree_depths", "tree_mask", "tree_rows"]


def check_parents(parents: Sequence[int], n: int, *, name: str = "parents") -> None:
    """Raise ValueError unless node ``j < n`` has a parent in ``-1 .. j - 1`` (the root is -1)."""
    if len(parents) < n:
        raise ValueError(f"{name} has {len(parents)} entries for {n} draft nodes")
    bad = [(j, p) for j, p in enumerate(parents[:n]) if not -1 <= p < j]
    if bad:
        raise ValueError(
            f"{name} must list each node's parent before the node (-1 for the root's children, "
            f"else an earlier node's index); got (node, parent) {bad[:4]}"
        )


def tree_depths(parents: Sequence[int], n: int) -> list[int]:
    """``[n + 1]`` depth of every verify row: 0 for the root, parent's depth + 1 for a node."""
    depth = [0] * (n + 1)
    for j in range(n):
        depth[j + 1] = depth[parents[j] + 1] + 1
    return depth


def tree_mask(parents: Sequence[int], n: int) -> torch.Tensor:
    """``[n + 1, n + 1]`` bool: row ``r`` sees row ``c`` iff ``c`` is ``r`` or an ancestor."""
    # Host lists, one tensor at the end: a row assignment on a tensor costs ~8 us, 4-5x the
    # whole row as a list copy (it runs for every request of every tree step).
    rows = [[True] + [False] * n]
    for j in range(n):
        row = rows[parents[j] + 1].copy()
        row[j + 1] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def tree_rows(
    parents: Sequence[Sequence[int]], num_nodes: Sequence[int], starts: Sequence[int]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per sequence: RoPE positions ``start + depth`` of its verify rows, and its tree mask."""
    positions, masks = [], []
    for row_parents, n, start in zip(parents, num_nodes, starts, strict=True):
        check_parents(row_parents, n)
        positions.append([start + d for d in tree_depths(row_parents, n)])
        masks.append(tree_mask(row_parents, n))
    return positions, masks


def kept_first_order(paths: Sequence[Sequence[int]], q_lens: Sequence[int]) -> list[int]:
    """A permutation of the pass's flat rows: each sequence's kept path (in path order) first,
    then its other rows in their original order, sequences one after another.

    Gathering the pass's per-row data (input tokens, hidden states) by it puts each sequence's
    committed rows first, in the order their KV now sits, with ``qo_indptr`` unchanged.
    """
    order, offset = [], 0
    for path, q in zip(paths, q_lens, strict=True):
        kept = set(path)
        order.extend(offset + r for r in [*path, *(r for r in range(q) if r not in kept)])
        offset += q
    return order
