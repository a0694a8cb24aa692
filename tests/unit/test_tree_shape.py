"""TreeShape's limits (a dynamic tree's expanded nodes need draft rows in the verify slots) and
its growth rule: pruning for the nodes that will be kept changes nothing that is kept."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from specdec.config import MAX_SPECULATIVE_TOKENS
from specdec.proposers.tree_shape import Node, TreeShape, best_first, expansions


@pytest.mark.parametrize(("top_k", "depth"), [(4, 5), (2, 5), (1, 3), (3, 1), (8, 2)])
def test_min_verify_tokens_is_the_smallest_shape_accepted(top_k, depth):
    n = TreeShape.min_verify_tokens(top_k, depth)
    assert TreeShape(top_k=top_k, depth=depth, num_verify_tokens=n).num_nodes == n
    if n > 1:
        with pytest.raises(ValueError, match="slots are reserved"):
            TreeShape(top_k=top_k, depth=depth, num_verify_tokens=n - 1)


def _grow(shape: TreeShape, keep: int | None, seed: int, max_depth: int) -> tuple[list[Node], int]:
    """A dynamic tree grown as EAGLETree grows it, the head replaced by log-probabilities drawn
    from (seed, the node's rank path): coarse values, so ties happen, and some ``-inf``.
    Returns the nodes and how many nodes were expanded (the head's rows)."""
    nodes: list[Node] = []
    expanded = 0
    for depth in range(1, max_depth + 1):
        plan = expansions(shape, nodes, depth, keep)
        if not plan:
            break
        for parent, ranks in plan:
            prefix = () if parent < 0 else nodes[parent].ranks
            expanded += parent >= 0
            g = torch.Generator().manual_seed(hash((seed, prefix)) % 2**31)
            logp = -torch.randint(0, 6, (shape.top_k,), generator=g).float()
            logp = torch.where(torch.rand(shape.top_k, generator=g) < 0.05, float("-inf"), logp)
            logp = logp.sort(descending=True).values.tolist()  # ranks in the head's order
            base = 0.0 if parent < 0 else nodes[parent].score
            for rank in ranks:
                token = hash((seed, prefix, rank)) % 1000
                nodes.append(Node(token, parent, depth, base + logp[rank], (*prefix, rank)))
    return nodes, expanded


def _kept(shape: TreeShape, keep: int, prune_for: int | None, seed: int) -> tuple[list, list, int]:
    nodes, expanded = _grow(shape, prune_for, seed, min(shape.depth, keep))
    kept, parents = best_first(nodes, keep)
    return [nodes[i].ranks for i in kept], parents, expanded


@pytest.mark.parametrize(("top_k", "depth"), [(4, 5), (2, 5), (3, 4), (1, 4)])
def test_pruned_growth_keeps_the_same_nodes_with_fewer_head_rows(top_k, depth):
    """Expanding only the nodes that can lead to one of the ``keep`` best gives the same kept
    nodes, in the same order, as the full EAGLE-2 tree, for every ``keep``, and saves rows."""
    shape = TreeShape(top_k=top_k, depth=depth, num_verify_tokens=MAX_SPECULATIVE_TOKENS)
    saved = 0
    for seed in range(40):
        for keep in range(1, 17):
            full = _kept(shape, keep, None, seed)
            pruned = _kept(shape, keep, keep, seed)
            assert pruned[:2] == full[:2], (seed, keep)
            assert pruned[2] <= full[2]
            saved += full[2] - pruned[2]
    assert saved > 0 or top_k == 1


def test_negative_control_pruning_one_node_too_many_changes_the_kept_nodes():
    """The check above notices an off-by-one: pruning as if one node fewer were kept loses
    kept nodes on some trees."""
    shape = TreeShape(top_k=4, depth=5, num_verify_tokens=MAX_SPECULATIVE_TOKENS)
    differs = sum(
        _kept(shape, keep, keep - 1, seed)[:2] != _kept(shape, keep, None, seed)[:2]
        for seed in range(20)
        for keep in range(2, 9)
    )
    assert differs > 0


def _cut(nodes: list[Node], keep: int, min_prob: float) -> list[tuple[int, ...]]:
    """Reference for min_path_prob: the ``keep`` best nodes of the full tree, then every node past
    the best whose path probability is below ``min_prob`` dropped."""
    kept, _ = best_first(nodes, keep)
    return [nodes[i].ranks for j, i in enumerate(kept) if j == 0 or math.exp(nodes[i].score) >= min_prob]


@pytest.mark.parametrize("min_prob", [0.01, 0.05, 0.2, 0.5])
@pytest.mark.parametrize(("top_k", "depth"), [(4, 5), (2, 5), (3, 3)])
def test_min_path_prob_keeps_the_confident_nodes_of_the_full_tree_with_fewer_head_rows(top_k, depth, min_prob):
    """Growth that never expands a node below the floor, cut by ``best_first``'s floor, keeps
    exactly the full tree's best nodes that reach the floor (the best one always), parents
    first; it expands no more nodes, and trees of several sizes come out."""
    full_shape = TreeShape(top_k=top_k, depth=depth, num_verify_tokens=MAX_SPECULATIVE_TOKENS)
    shape = attrs.evolve(full_shape, min_path_prob=min_prob)
    sizes, saved = set(), 0
    for seed in range(40):
        for keep in (1, 2, 4, 8, 16):
            full, full_rows = _grow(full_shape, keep, seed, min(depth, keep))
            nodes, rows = _grow(shape, keep, seed, min(depth, keep))
            kept, parents = best_first(nodes, keep, shape.min_score)
            assert [nodes[i].ranks for i in kept] == _cut(full, keep, min_prob), (seed, keep)
            assert all(p < j for j, p in enumerate(parents))  # a tree, parents first
            assert rows <= full_rows
            saved += full_rows - rows
            sizes.add(len(kept))
    assert len(sizes) >= 2 and saved > 0


def test_negative_control_a_floor_applied_to_growth_only_keeps_unconfident_nodes():
    """The check above notices a floor that prunes growth but not the verified nodes."""
    shape = TreeShape(top_k=4, depth=5, num_verify_tokens=MAX_SPECULATIVE_TOKENS, min_path_prob=0.2)
    differs = 0
    for seed in range(20):
        nodes, _ = _grow(shape, 8, seed, 5)
        kept, _ = best_first(nodes, 8)  # the bug: no floor on what is verified
        differs += [nodes[i].ranks for i in kept] != _cut(nodes, 8, 0.2)
    assert differs > 0


@pytest.mark.parametrize("bad", [1.0, -0.1, 2, float("nan")])
def test_min_path_prob_is_checked(bad):
    with pytest.raises(ValueError, match=r"min_path_prob must be (in \[0, 1\)|finite)"):
        TreeShape(min_path_prob=bad)
