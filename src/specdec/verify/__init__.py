"""Verifiers: decide, per sequence, which drafted tokens the target's distribution keeps."""

from specdec.verify.chain import (
    ChainVerifier,
    acceptance_probability,
    greedy_verify,
    rejection_verify,
    residual_distribution,
)
from specdec.verify.tree import (
    TreeVerifier,
    children_of,
    sibling_step_deterministic,
    sibling_step_without_replacement,
    tree_coupled_verify,
    tree_greedy_verify,
    tree_rejection_path,
    tree_rejection_verify,
)

__all__ = [
    "ChainVerifier",
    "TreeVerifier",
    "acceptance_probability",
    "children_of",
    "greedy_verify",
    "rejection_verify",
    "residual_distribution",
    "sibling_step_deterministic",
    "sibling_step_without_replacement",
    "tree_coupled_verify",
    "tree_greedy_verify",
    "tree_rejection_path",
    "tree_rejection_verify",
]
