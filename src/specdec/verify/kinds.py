"""What each proposal kind needs from verification: its verifier (a table, not branches)."""

from __future__ import annotations

from specdec.interfaces import Verifier
from specdec.types import ProposalKind
from specdec.verify.chain import ChainVerifier
from specdec.verify.tree import TreeVerifier

__all__ = ["default_verifiers"]


def default_verifiers() -> dict[ProposalKind, Verifier]:
    """A fresh verifier for every proposal kind (chain: rejection sampling; tree: multi-draft)."""
    return {ProposalKind.CHAIN: ChainVerifier(), ProposalKind.TREE: TreeVerifier()}
