"""How a draft tree grows: a static list of paths (EAGLE-1) or the dynamic rule (EAGLE-2).

Both are data for one proposer. A tree grows depth by depth: at depth ``d`` some nodes of depth
``d - 1`` (the root at ``d = 1``) are *expanded*: the head's distribution after them is ranked
and the children take the tokens of chosen ranks. Every node scores the sum of the draft's
log-probabilities along its path.

- Static: ``paths`` such as ``[[0], [1], [0, 0], [0, 1], [0, 0, 0]]``; a path lists child ranks
  from the root (``[0, 1]``: the second-best child of the best child of the root).
- Dynamic (EAGLE-2): the root gets ``top_k`` children; at each later depth the ``top_k``
  best-scoring nodes of the previous depth get ``top_k`` children each; after ``depth`` depths
  the ``num_verify_tokens`` best-scoring nodes are kept. Told how many nodes will be kept,
  growth skips the nodes that cannot lead to one of them (same kept nodes, less drafting).

A child never scores above its parent (log-probabilities are <= 0), so ranking all nodes by
``(-score, depth, creation order)`` puts every parent before its children: any prefix of that
order is a tree. That order is the proposal's node order, so a policy asking for ``n`` nodes
gets the ``n`` best (:func:`best_first`).

``min_path_prob`` sizes each step's tree by the draft's own confidence: only nodes whose path
probability under the draft (``exp(score)``) reaches it are verified, the best node always, and
growth never expands a node below it (its children score lower still). Where the draft is sure
a step verifies a deep tree, where it hesitates one node: the verify rows and head forwards a
fixed size spends on nodes the target rarely keeps are saved (a node's path probability is
about how often it is kept, for a calibrated draft: EAGLE-2's observation). The rule reads the
draft's scores only, so verification stays exact.

Example:
    >>> shape = TreeShape.static([[0], [1], [0, 0]])
    >>> shape.num_nodes, shape.max_depth
    (3, 2)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from specdec.config import MAX_SPECULATIVE_TOKENS, unit_interval_closed_open

__all__ = ["Node", "TreeShape", "best_first", "expansions"]


def _paths(value: object) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    try:
        return tuple(tuple(path) for path in value)
    except TypeError:
        raise TypeError(f"tree must be a list of paths (lists of child ranks), got {value!r}") from None


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class TreeShape:
    """A static tree (``paths``) or the dynamic rule (``top_k``, ``depth``, ``num_verify_tokens``);
    ``min_path_prob`` in [0, 1): the least path probability of a verified node (the best node is
    always verified; 0: every node of the size asked for)."""

    paths: tuple[tuple[int, ...], ...] | None = attrs.field(default=None, converter=_paths)
    top_k: int = attrs.field(default=4, validator=_positive)
    depth: int = attrs.field(default=5, validator=_positive)
    num_verify_tokens: int = attrs.field(default=16, validator=_positive)
    min_path_prob: float = attrs.field(default=0.0, validator=unit_interval_closed_open)

    def __attrs_post_init__(self) -> None:
        if self.paths is not None:
            _check_paths(self.paths)
        if self.num_nodes > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"a tree has at most {MAX_SPECULATIVE_TOKENS} draft nodes, got {self.num_nodes}"
            )
        # Draft rows of expanded nodes live in the slots reserved for verification.
        if self.max_expanded > self.num_nodes + 1:
            raise ValueError(
                f"top_k * (depth - 1) = {self.max_expanded} nodes would be expanded but only "
                f"num_verify_tokens + 1 = {self.num_nodes + 1} slots are reserved; lower top_k "
                "or depth, or raise num_verify_tokens"
            )

    @staticmethod
    def min_verify_tokens(top_k: int, depth: int) -> int:
        """The fewest ``num_verify_tokens`` a dynamic tree of ``top_k`` and ``depth`` allows: its
        expanded nodes' draft rows must fit in the verification slots.

        >>> TreeShape.min_verify_tokens(4, 5)
        15
        """
        return max(1, top_k * (depth - 1) - 1)

    @classmethod
    def static(cls, paths: Sequence[Sequence[int]]) -> TreeShape:
        return cls(paths=paths)

    @property
    def is_static(self) -> bool:
        return self.paths is not None

    @property
    def num_nodes(self) -> int:
        """Draft nodes in a full tree (the proposal's width)."""
        return len(self.paths) if self.paths is not None else self.num_verify_tokens

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths) if self.paths is not None else self.depth

    @property
    def min_score(self) -> float:
        """The least score (summed log-probability) of a node past the best: ``log(min_path_prob)``."""
        return math.log(self.min_path_prob) if self.min_path_prob > 0 else float("-inf")

    @property
    def max_expanded(self) -> int:
        """The most nodes that get children (each needs a draft row of the head)."""
        if self.paths is not None:
            return len({p[:-1] for p in self.paths if len(p) > 1})
        return self.top_k * (self.depth - 1)


def _check_paths(paths: tuple[tuple[int, ...], ...]) -> None:
    if not paths:
        raise ValueError("tree must hold at least one path")
    seen = set()
    for path in paths:
        if not path or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
            raise ValueError(f"tree paths must be non-empty lists of ranks >= 0, got {list(path)}")
        if path in seen:
            raise ValueError(f"tree lists path {list(path)} twice")
        seen.add(path)
    missing = [list(p) for p in paths if len(p) > 1 and p[:-1] not in seen]
    if missing:
        raise ValueError(f"tree paths {missing[:4]} lack their parent path")


@attrs.frozen
class Node:
    """One draft node: its token, parent node (-1: the root), depth, score and rank path."""

    token: int
    parent: int
    depth: int
    score: float  # sum of the draft's log-probabilities from the root
    ranks: tuple[int, ...]  # child ranks from the root (how a static tree names it)


def expansions(
    shape: TreeShape, nodes: Sequence[Node], depth: int, keep: int | None = None
) -> list[tuple[int, list[int]]]:
    """Which nodes get children at ``depth`` and the ranks those children take.

    Returns ``(node index, ranks)`` pairs, node index ``-1`` for the root (``depth == 1``).

    ``keep``: how many nodes :func:`best_first` will keep (the verified ones). A dynamic tree
    then skips the frontier nodes that cannot have a kept descendant: those outside the
    ``keep - 1`` best nodes so far. Later nodes only push a node down the order and a
    descendant sorts after its ancestor, so such a node's descendants rank ``keep``-th or
    worse. The kept nodes are the same as without ``keep`` (every node that ranks above a
    skipped one's children still exists, so the frontiers agree on the nodes that matter)
    while the head runs fewer rows, and no depth at all once nothing can be kept below it.
    Nodes scoring below ``shape.min_score`` are not expanded either: no child of theirs can be
    verified.
    """
    if depth == 1:
        if shape.paths is not None:
            return [(-1, sorted(p[0] for p in shape.paths if len(p) == 1))]
        return [(-1, list(range(shape.top_k)))]
    floor = shape.min_score
    previous = [i for i, node in enumerate(nodes) if node.depth == depth - 1 and node.score >= floor]
    if shape.paths is not None:
        wanted: dict[tuple[int, ...], list[int]] = {}
        for p in shape.paths:
            if len(p) == depth:
                wanted.setdefault(p[:-1], []).append(p[-1])
        return [(i, sorted(wanted[nodes[i].ranks])) for i in previous if nodes[i].ranks in wanted]
    frontier = sorted(previous, key=lambda i: (-nodes[i].score, i))[: shape.top_k]
    if keep is not None:
        can_lead = set(_ranked(nodes)[: keep - 1])  # the nodes a kept node can descend from
        frontier = [i for i in frontier if i in can_lead]
    return [(i, list(range(shape.top_k))) for i in sorted(frontier)]


def _ranked(nodes: Sequence[Node]) -> list[int]:
    """Node indices best first, ``-inf`` scores (tokens the draft rules out) left out."""
    return sorted(
        (i for i, node in enumerate(nodes) if node.score != float("-inf")),
        key=lambda i: (-nodes[i].score, nodes[i].depth, i),
    )


def best_first(
    nodes: Sequence[Node], n: int, min_score: float = float("-inf")
) -> tuple[list[int], list[int]]:
    """The ``n`` best nodes, parents first: their indices into ``nodes``, and each one's
    parent as an index into that list (-1: the root). Nodes scoring ``-inf`` (tokens the draft
    rules out) are never kept, nor nodes past the best scoring below ``min_score`` (a prefix of
    the order: a parent never scores below its child)."""
    kept = _ranked(nodes)[:n]
    while len(kept) > 1 and nodes[kept[-1]].score < min_score:
        kept.pop()
    position = {node: j for j, node in enumerate(kept)}
    parents = [-1 if nodes[i].parent < 0 else position[nodes[i].parent] for i in kept]
    return kept, parents
