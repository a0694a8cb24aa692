"""What each proposal kind needs around the verify pass: tables from kind to object.

``default_verifiers()`` gives each kind's verifier (the rules that accept drafts) and
``default_kind_rules()`` its :class:`~specdec.interfaces.KindRules`: a chain's rows are causal
and its kept prefix is already in place; a tree's rows sit at ``start + depth`` under tree
masks, and its kept path is compacted into place and put first (:mod:`.tree_layout`). The
engine looks both up by ``proposal.kind`` and never branches on it.

Example:
    >>> ChainKind().caps((3, 0), lookahead=8), TreeKind().caps((3, 0), lookahead=8)
    ((3, 0), (8, 0))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.interfaces import KindRules, Verifier
from specdec.types import BatchLayout, DraftProposal, ProposalKind, VerifyRows
from specdec.verify.chain import ChainVerifier
from specdec.verify.tree import TreeVerifier
from specdec.verify.tree_layout import check_parents, kept_first_order, tree_depths, tree_rows

if TYPE_CHECKING:
    from specdec.kv.paged import KVCacheManager

__all__ = ["ChainKind", "TreeKind", "default_kind_rules", "default_verifiers"]


def default_verifiers() -> dict[ProposalKind, Verifier]:
    """A fresh verifier for every proposal kind (chain: rejection sampling; tree: multi-draft)."""
    return {ProposalKind.CHAIN: ChainVerifier(), ProposalKind.TREE: TreeVerifier()}


def default_kind_rules() -> dict[ProposalKind, KindRules]:
    """The rules of every proposal kind around the verify pass (stateless, shareable)."""
    return {ProposalKind.CHAIN: ChainKind(), ProposalKind.TREE: TreeKind()}


class ChainKind:
    """The :class:`~specdec.interfaces.KindRules` of chains: draft ``j`` is verify row
    ``j + 1`` at the next position, and a kept prefix is already where its KV belongs."""

    pads_to_width = True  # causal rows padded past the drafts are never judged

    def caps(self, caps: Sequence[int], lookahead: int) -> tuple[int, ...]:
        """A chain's k counts positions: each request keeps at most its own cap."""
        return tuple(caps)

    def propose_steps(self, proposal: DraftProposal, lookahead: int) -> int:
        """The drafting steps actually taken: a proposer may end its chains early."""
        return proposal.width

    def read_drafts(self, proposal: DraftProposal) -> tuple[list[list[int]], None]:
        """The drafts as host lists (one device-to-host copy); a chain has no parents."""
        return proposal.draft_token_ids.to(torch.int64).tolist(), None

    def verify_rows(
        self, parents: None, num_draft: Sequence[int], starts: Sequence[int]
    ) -> VerifyRows:
        """Causal rows at the slots' own positions; a chain's depth is its length."""
        return VerifyRows(positions=None, tree_masks=None, depths=list(num_draft))

    def row_histories(self, drafts: Sequence[int], parents: None, n: int) -> list[list[int]]:
        """Row ``j`` follows drafts ``0 .. j - 1``."""
        return [list(drafts[:j]) for j in range(n + 1)]

    def commit(self, manager: KVCacheManager, layout: BatchLayout, starts, paths, hidden):
        """Nothing moves: the kept rows are each sequence's first rows already."""
        return layout.token_ids, hidden


class TreeKind:
    """The :class:`~specdec.interfaces.KindRules` of trees: node ``j`` is verify row ``j + 1``
    at position ``start + depth``, seeing its ancestors; the kept path's KV is moved to the
    slots right after the prefix."""

    pads_to_width = False  # a tree's rows have their own masks: no uniform padded pass

    def caps(self, caps: Sequence[int], lookahead: int) -> tuple[int, ...]:
        """A tree's k counts nodes, not positions: any width fits while one draft can be kept
        (tokens past the budget are cut by the stop check, as for chains)."""
        return tuple(lookahead if c > 0 else 0 for c in caps)

    def propose_steps(self, proposal: DraftProposal, lookahead: int) -> int:
        """A tree's drafting cost grows with the nodes asked for."""
        return lookahead

    def read_drafts(self, proposal: DraftProposal) -> tuple[list[list[int]], list[list[int]]]:
        """Drafts and parents as host lists, stacked into one device-to-host copy; parents
        checked (each node's parent listed before it)."""
        ids = proposal.draft_token_ids.to(torch.int64)  # [batch, width]
        parents = proposal.parents
        if parents is None or tuple(parents.shape) != tuple(ids.shape):
            got = None if parents is None else tuple(parents.shape)
            raise ValueError(
                f"a tree proposal needs parents of shape [batch, width] = "
                f"{tuple(ids.shape)}, got {got}"
            )
        drafts, parent_rows = torch.stack([ids, parents.to(ids.device, torch.int64)]).tolist()
        for row, n in zip(parent_rows, proposal.num_draft_tokens):
            check_parents(row, n, name="proposal parents")
        return drafts, parent_rows

    def verify_rows(
        self, parents: list[list[int]], num_draft: Sequence[int], starts: Sequence[int]
    ) -> VerifyRows:
        """Rows at ``start + depth`` with their tree masks; each tree's depth."""
        positions, masks = tree_rows(parents, num_draft, starts)
        depths = [max(tree_depths(p, n)) for p, n in zip(parents, num_draft)]
        return VerifyRows(positions=positions, tree_masks=masks, depths=depths)

    def row_histories(
        self, drafts: Sequence[int], parents: Sequence[int], n: int
    ) -> list[list[int]]:
        """Row 0 follows the root; row ``j + 1`` follows node ``j``'s path (root excluded)."""
        paths: list[list[int]] = []
        for j in range(n):
            parent = parents[j]
            paths.append((paths[parent] if parent >= 0 else []) + [drafts[j]])
        return [[], *paths]

    def commit(self, manager: KVCacheManager, layout: BatchLayout, starts, paths, hidden):
        """Compact each kept path into place (every KV pool), and gather the input ids and
        hidden states so each sequence's kept rows come first, in path order."""
        for seq_id, start, path in zip(layout.seq_ids, starts, paths, strict=True):
            manager.compact(seq_id, [start + r for r in path], start)
        order = torch.tensor(kept_first_order(paths, layout.q_lens), dtype=torch.int64)
        input_ids = layout.token_ids[order.to(layout.token_ids.device)]  # [num rows] int64
        hidden = None if hidden is None else hidden[order.to(hidden.device)]
        return input_ids, hidden
