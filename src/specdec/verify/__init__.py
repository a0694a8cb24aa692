"""Verifiers: decide, per sequence, which drafted tokens the target's distribution keeps."""

from specdec.verify.chain import (
    ChainVerifier,
    acceptance_probability,
    greedy_verify,
    rejection_verify,
    residual_distribution,
)

__all__ = [
    "ChainVerifier",
    "acceptance_probability",
    "greedy_verify",
    "rejection_verify",
    "residual_distribution",
]
